"""The vocabulary settings are declared in (a Spec on each dataclass field, a Range of numbers), one
setting as the rest of kvchat sees it (SettingInfo), and the check of a value against its declaration.
Plain Python (no torch), so `kvchat --help` stays fast.
"""

from __future__ import annotations

import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Range:
    """Numbers from `low` to `high` (None: unbounded), each end open or closed."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: object) -> bool:
        assert isinstance(value, int | float)
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {_number(self.high)}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{_number(self.low)}, {_number(self.high)}{right}"


@dataclass(frozen=True)
class Spec:
    """What a setting's field declares beside its name, type and default."""

    help: str
    live: bool = False  # applies to the running session; otherwise read when kvchat starts
    flag: str | None = None  # the command-line option, e.g. "--top-p"
    range: Range | None = None
    note: str = ""  # what a special value means, e.g. "0 is greedy"
    choices: tuple[str, ...] = ()
    aliases: Mapping[str, str] = field(default_factory=dict)  # other spellings of a choice
    pattern: str | None = None  # a regular expression the whole value must match
    pattern_help: str = ""  # the rule the pattern stands for, e.g. "must be auto, cpu, cuda or cuda:N"
    detail: str = ""  # more than --help says, written into configs/default.toml
    example: Any = None  # for a setting unset by default: the value default.toml shows commented out


def setting(default: Any, help: str, **spec: Any) -> Any:
    """A dataclass field that carries its Spec."""
    return field(default=default, metadata={"spec": Spec(help, **spec)})


def _number(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class SettingInfo:
    """One setting as the rest of kvchat sees it."""

    table: str
    name: str
    type: Any  # int, float, str, bool, tuple[str, ...], or `X | None`
    default: Any
    spec: Spec

    @property
    def key(self) -> str:
        return f"{self.table}.{self.name}"

    @property
    def value_type(self) -> Any:
        """The type without `| None`."""
        if isinstance(self.type, types.UnionType):
            (inner,) = [arg for arg in typing.get_args(self.type) if arg is not type(None)]
            return inner
        return self.type

    @property
    def optional(self) -> bool:
        return isinstance(self.type, types.UnionType) and type(None) in typing.get_args(self.type)


def normalize(info: SettingInfo, value: Any) -> Any:
    """Another accepted spelling of a choice (`bfloat16`, `BF16`) as its own name (`bf16`)."""
    if not isinstance(value, str) or not info.spec.choices:
        return value
    lowered = value.strip().lower()
    return info.spec.aliases.get(lowered, lowered if lowered in info.spec.choices else value)


def problem(info: SettingInfo, value: Any) -> str | None:
    """Why `value` (already of the setting's type) is not valid for it, or None."""
    spec = info.spec
    if value is None:
        return None if info.optional else "must be set"
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    if spec.range is not None and value not in spec.range:
        return f"must be {spec.range}" + (f" ({spec.note})" if spec.note else "")
    if spec.choices and value not in spec.choices:
        return f"must be one of {', '.join(spec.choices)}"
    if spec.pattern is not None and re.fullmatch(spec.pattern, value) is None:
        return spec.pattern_help or f"must match {spec.pattern}"
    if isinstance(value, tuple) and not all(value):
        return "must not contain empty strings"
    return None
