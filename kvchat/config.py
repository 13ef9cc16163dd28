"""Typed settings: configs/default.toml, then a user file, then overrides (CLI flags, `/set`)."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchat.engine.sampling import SamplingParams
from kvchat.errors import ConfigError

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_FILE = CONFIGS_DIR / "default.toml"

DTYPES = ("auto", "bf16", "fp32", "fp16")
REUSE_MODES = ("exact", "reposition", "repair")
REPAIR_STRATEGIES = ("prefix", "deviation")
_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
_TRUE_WORDS = ("true", "on", "yes", "1")
_FALSE_WORDS = ("false", "off", "no", "0")


@dataclass(frozen=True)
class ModelSettings:
    """Which model to run, and where."""

    model: str = "smollm2-135m"
    dtype: str = "auto"
    device: str = "auto"
    threads: int = 0


@dataclass(frozen=True)
class CacheSettings:
    """The paged KV cache's size and the prefill step."""

    kv_memory_mb: int = 512
    block_size: int = 16
    prefill_chunk: int = 512


@dataclass(frozen=True)
class ReuseSettings:
    """How cached chunks are reused at a position other than where they were computed."""

    mode: str = "exact"
    repair_share: float = 0.15
    repair_min_tokens: int = 4
    repair_strategy: str = "prefix"
    verify_tokens: int = 16


@dataclass(frozen=True)
class UiSettings:
    """How the REPL shows things."""

    color: bool = True
    json: bool = False
    debug: bool = False
    history_file: str = "~/.local/share/kvchat/history"
    show_thinking: bool = True


@dataclass(frozen=True)
class Settings:
    """Every setting, one field per TOML table."""

    model: ModelSettings = ModelSettings()
    cache: CacheSettings = CacheSettings()
    sampling: SamplingParams = SamplingParams()
    reuse: ReuseSettings = ReuseSettings()
    ui: UiSettings = UiSettings()


TABLES: dict[str, type] = typing.get_type_hints(Settings)

# A value of the right type that fails its check is rejected with the message.
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model.model": (lambda v: bool(v.strip()), "must not be empty"),
    "model.dtype": (lambda v: v in DTYPES, f"must be one of {', '.join(DTYPES)}"),
    "model.device": (lambda v: _DEVICE_PATTERN.fullmatch(v) is not None, "must be auto, cpu, cuda or cuda:N"),
    "model.threads": (lambda v: v >= 0, "must be >= 0 (0 picks automatically)"),
    "cache.kv_memory_mb": (lambda v: v >= 1, "must be >= 1"),
    "cache.block_size": (lambda v: 1 <= v <= 1024, "must be in 1..1024"),
    "cache.prefill_chunk": (lambda v: v >= 1, "must be >= 1"),
    "sampling.temperature": (lambda v: v >= 0, "must be >= 0 (0 is greedy)"),
    "sampling.top_k": (lambda v: v >= 0, "must be >= 0 (0 is off)"),
    "sampling.top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "sampling.min_p": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "sampling.repetition_penalty": (lambda v: v > 0, "must be > 0 (1 is off)"),
    "sampling.max_tokens": (lambda v: v >= 1, "must be >= 1"),
    "sampling.seed": (lambda v: v is None or v >= 0, "must be >= 0"),
    "sampling.stop": (lambda v: all(v), "must not contain empty strings"),
    "reuse.mode": (lambda v: v in REUSE_MODES, f"must be one of {', '.join(REUSE_MODES)}"),
    "reuse.repair_share": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "reuse.repair_min_tokens": (lambda v: v >= 0, "must be >= 0"),
    "reuse.repair_strategy": (
        lambda v: v in REPAIR_STRATEGIES,
        f"must be one of {', '.join(REPAIR_STRATEGIES)}",
    ),
    "reuse.verify_tokens": (lambda v: v >= 1, "must be >= 1"),
}

Layer = dict[str, dict[str, object]]


def load_settings(user_file: Path | None = None, overrides: Layer | None = None) -> Settings:
    """Read the defaults, then the user file (explicit, `$KVCHAT_CONFIG`, or ~/.config/kvchat/config.toml),
    then `overrides` (`{"sampling": {"temperature": 0.7}}`; None values are ignored)."""
    values: Layer = {table: {} for table in TABLES}
    _merge(values, _read_toml(DEFAULT_FILE), str(DEFAULT_FILE))
    path = user_file or find_user_file()
    if path is not None:
        _merge(values, _read_toml(path), str(path))
    if overrides:
        _merge(values, overrides, "overrides")
    return Settings(**{table: cls(**values[table]) for table, cls in TABLES.items()})


def find_user_file() -> Path | None:
    """`$KVCHAT_CONFIG` if set, else `$XDG_CONFIG_HOME/kvchat/config.toml` (~/.config) if it exists."""
    explicit = os.environ.get("KVCHAT_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or "~/.config").expanduser()
    path = config_home / "kvchat" / "config.toml"
    return path if path.is_file() else None


def settings_as_dict(settings: Settings) -> dict[str, dict[str, object]]:
    """Every setting as `{table: {key: value}}`, in declaration order."""
    return {table: dataclasses.asdict(getattr(settings, table)) for table in TABLES}


def replace_setting(settings: Settings, key: str, text: str) -> Settings:
    """Return `settings` with `key` (`table.key`, or a key unique across tables) set to `text` parsed."""
    table, name = resolve_key(key)
    field_type = _field_types(table)[name]
    value = _parse_text(text, field_type, f"{table}.{name}")
    _check(table, name, value, None)
    section = dataclasses.replace(getattr(settings, table), **{name: value})
    return dataclasses.replace(settings, **{table: section})


def resolve_key(key: str) -> tuple[str, str]:
    """Split `table.key` or find the table of a bare key; ConfigError when unknown or ambiguous."""
    if "." in key:
        table, _, name = key.partition(".")
        if table not in TABLES or name not in _field_types(table):
            raise ConfigError(f"unknown setting {key!r}; known: {', '.join(all_keys())}")
        return table, name
    tables = [table for table in TABLES if key in _field_types(table)]
    if not tables:
        raise ConfigError(f"unknown setting {key!r}; known: {', '.join(all_keys())}")
    if len(tables) > 1:
        raise ConfigError(f"setting {key!r} is ambiguous: {', '.join(f'{t}.{key}' for t in tables)}")
    return tables[0], key


def all_keys() -> list[str]:
    """Every setting as `table.key`."""
    return [f"{table}.{name}" for table in TABLES for name in _field_types(table)]


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _merge(values: Layer, layer: Mapping[str, object], source: str) -> None:
    for table, entries in layer.items():
        if table not in TABLES:
            raise ConfigError(f"{source}: unknown table [{table}]; known: {', '.join(TABLES)}")
        if not isinstance(entries, Mapping):
            raise ConfigError(f"{source}: [{table}] must be a table")
        field_types = _field_types(table)
        for name, raw in entries.items():
            if name not in field_types:
                raise ConfigError(
                    f"{source}: unknown key {name!r} in [{table}]; known: {', '.join(field_types)}"
                )
            if raw is None:
                continue
            value = _coerce(raw, field_types[name])
            if value is _INVALID:
                raise ConfigError(
                    f"{source}: [{table}] {name} = {raw!r} must be {_type_name(field_types[name])}"
                )
            _check(table, name, value, source)
            values[table][name] = value


_INVALID = object()


def _coerce(raw: object, field_type: object) -> object:
    """`raw` as a value of `field_type`, or _INVALID. bool is never taken for an int."""
    if _is_optional(field_type):
        return _coerce(raw, _non_none(field_type))
    if field_type is bool:
        return raw if isinstance(raw, bool) else _INVALID
    if field_type is int:
        return raw if isinstance(raw, int) and not isinstance(raw, bool) else _INVALID
    if field_type is float:
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            return float(raw)
        return _INVALID
    if field_type is str:
        return raw if isinstance(raw, str) else _INVALID
    if typing.get_origin(field_type) is tuple:
        if isinstance(raw, list | tuple) and all(isinstance(item, str) for item in raw):
            return tuple(raw)
        return _INVALID
    raise AssertionError(f"unsupported setting type {field_type}")


def _parse_text(text: str, field_type: object, key: str) -> object:
    """Parse what a user typed after `/set KEY`."""
    text = text.strip()
    if _is_optional(field_type):
        if text.lower() in ("", "none"):
            return None
        field_type = _non_none(field_type)
    raw: object = text
    try:
        if field_type is bool and text.lower() in _TRUE_WORDS + _FALSE_WORDS:
            raw = text.lower() in _TRUE_WORDS
        elif field_type is int:
            raw = int(text)
        elif field_type is float:
            raw = float(text)
        elif typing.get_origin(field_type) is tuple:
            raw = tomllib.loads(f"v = {text}")["v"] if text.startswith("[") else ([text] if text else [])
    except (ValueError, tomllib.TOMLDecodeError):
        pass
    value = _coerce(raw, field_type)
    if value is _INVALID:
        raise ConfigError(f"{key} = {text!r}: expected {_type_name(field_type)}")
    return value


def _check(table: str, name: str, value: object, source: str | None) -> None:
    rule = _RULES.get(f"{table}.{name}")
    if rule is not None and not rule[0](value):
        where = f"{source}: [{table}] {name}" if source else f"{table}.{name}"
        raise ConfigError(f"{where} = {value!r} {rule[1]}")


@functools.cache
def _field_types(table: str) -> dict[str, object]:
    return typing.get_type_hints(TABLES[table])


def _is_optional(field_type: object) -> bool:
    return isinstance(field_type, types.UnionType) and type(None) in typing.get_args(field_type)


def _non_none(field_type: object) -> object:
    (inner,) = [arg for arg in typing.get_args(field_type) if arg is not type(None)]
    return inner


def _type_name(field_type: object) -> str:
    if _is_optional(field_type):
        return f"{_type_name(_non_none(field_type))} or none"
    if typing.get_origin(field_type) is tuple:
        return "a list of strings"
    names: dict[object, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(field_type, str(field_type))
