"""The declared schema of a state file's metadata: every type, range and cross-reference a load relies
on, checked before anything in the session changes. Pure Python: the tensors are checked in persist.

`parse_meta(text, limits)` returns the validated `SaveMeta` or raises `SchemaError` naming the first
thing wrong, e.g. `chunks.0.token_ids.3: token id 70000 is outside the vocabulary (0..49151)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvchat.chunks.types import Role

FORMAT = "kvchat-state/1"
ChunkId = Annotated[str, Field(pattern=r"^[0-9a-f]{10}$")]  # what registry.chunk_id_of makes


@dataclass(frozen=True)
class Limits:
    """What the session's model accepts: token ids below `vocab_size`, at most `max_positions`."""

    vocab_size: int
    max_positions: int | None


class SchemaError(ValueError):
    """The metadata breaks the schema; the message names the first thing wrong."""


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


def _limits_of(info: ValidationInfo) -> Limits:
    assert info.context is not None, "parse_meta passes the limits"
    return info.context["limits"]


def _check_token_ids(token_ids: list[int], info: ValidationInfo) -> list[int]:
    limits = _limits_of(info)
    for i, t in enumerate(token_ids):
        if not 0 <= t < limits.vocab_size:
            raise ValueError(f"token id {t} at {i} is outside the vocabulary (0..{limits.vocab_size - 1})")
    if limits.max_positions is not None and len(token_ids) > limits.max_positions:
        raise ValueError(f"{len(token_ids)} tokens, more than the model's {limits.max_positions} positions")
    return token_ids


class Layout(_Record):
    model_config = ConfigDict(strict=True, extra="allow", frozen=True)
    model_id: str
    fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int


class SpanRecord(_Record):
    start_pos: int = Field(ge=0)
    num_tokens: int = Field(ge=1)
    exact: bool
    pinned: bool
    where: Literal["live", "own"]

    @property
    def end(self) -> int:
        return self.start_pos + self.num_tokens


class ChunkRecord(_Record):
    chunk_id: ChunkId
    number: int = Field(ge=1)
    role: Role
    text: str
    token_ids: list[int] = Field(min_length=1)
    output_number: int | None = Field(ge=1)
    had_think: bool
    source_ids: list[str]
    is_default: bool
    finish_reason: Literal["stop", "stop_string", "length", "cancelled"] | None = None
    span: SpanRecord | None = None

    _token_ids = field_validator("token_ids")(_check_token_ids)

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> ChunkRecord:
        max_positions = _limits_of(info).max_positions
        if (self.role is Role.OUTPUT) != (self.output_number is not None):
            raise ValueError("an output and only an output has an output_number")
        if self.is_default and self.role is not Role.SYSTEM:
            raise ValueError("only a system prompt can be the template's default")
        if self.span is not None and self.span.num_tokens != len(self.token_ids):
            raise ValueError(f"span of {self.span.num_tokens} tokens for {len(self.token_ids)} token ids")
        if self.span is not None and max_positions is not None and self.span.end > max_positions:
            raise ValueError(f"span ends at {self.span.end}, past the model's {max_positions} positions")
        return self


class LiveRecord(_Record):
    token_ids: list[int] = Field(min_length=1)
    exact: int = Field(ge=0)

    _token_ids = field_validator("token_ids")(_check_token_ids)

    @model_validator(mode="after")
    def _exact_in_range(self) -> LiveRecord:
        if self.exact > len(self.token_ids):
            raise ValueError(f"exact {self.exact} is past its {len(self.token_ids)} tokens")
        return self


class ContextRecord(_Record):
    system: ChunkId | None
    middle: list[ChunkId]
    turns: list[ChunkId]
    query: ChunkId | None


# The roles each place of the context holds.
_PLACES: dict[str, set[Role]] = {
    "system": {Role.SYSTEM},
    "middle": {Role.CONTEXT, Role.OUTPUT},
    "turns": {Role.USER, Role.OUTPUT},
    "query": {Role.QUERY},
}


class SaveMeta(_Record):
    format: Literal["kvchat-state/1"]
    layout: Layout
    chunks: list[ChunkRecord]
    context: ContextRecord
    live: LiveRecord | None

    @model_validator(mode="after")
    def _unique(self) -> SaveMeta:
        for what, values in (
            ("chunk id", [c.chunk_id for c in self.chunks]),
            ("chunk number", [c.number for c in self.chunks]),
            ("output number", [c.output_number for c in self.chunks if c.output_number is not None]),
        ):
            seen: set = set()
            for value in values:
                if value in seen:
                    raise ValueError(f"{what} {value!r} appears twice")
                seen.add(value)
        return self

    @model_validator(mode="after")
    def _context_resolves(self) -> SaveMeta:
        roles = {c.chunk_id: c.role for c in self.chunks}
        ctx = self.context
        places = {"system": [ctx.system] if ctx.system else [], "middle": ctx.middle, "turns": ctx.turns}
        places["query"] = [ctx.query] if ctx.query else []
        for place, ids in places.items():
            if len(set(ids)) != len(ids):
                raise ValueError(f"context.{place} names a chunk twice")
            for chunk_id in ids:
                if chunk_id not in roles:
                    raise ValueError(f"context.{place} names chunk {chunk_id}, which the file lacks")
                if roles[chunk_id] not in _PLACES[place]:
                    raise ValueError(f"context.{place} holds chunk {chunk_id}, a {roles[chunk_id].value}")
        return self

    @model_validator(mode="after")
    def _live_spans_fit(self) -> SaveMeta:
        for i, chunk in enumerate(self.chunks):
            span = chunk.span
            if span is None or span.where != "live":
                continue
            where = f"chunks.{i}.span"
            if self.live is None:
                raise ValueError(f"{where}: in the live sequence of a file that has none")
            if self.live.token_ids[span.start_pos : span.end] != chunk.token_ids:
                raise ValueError(f"{where}: live tokens {span.start_pos}..{span.end} are not the chunk's")
            if span.exact and span.end > self.live.exact:
                raise ValueError(
                    f"{where}: exact, but past the live sequence's {self.live.exact} exact tokens"
                )
        return self


def parse_meta(text: str, limits: Limits) -> SaveMeta:
    """The metadata JSON checked against the schema; raises SchemaError naming the first fault."""
    try:
        return SaveMeta.model_validate_json(text, strict=True, context={"limits": limits})
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        *parent, last = [str(part) for part in first["loc"]] or [""]
        if first["type"] == "missing":
            raise SchemaError(f"{'.'.join(parent) or 'the file'} lacks {last}") from None
        where = ".".join([*parent, last])
        message = first["msg"].removeprefix("Value error, ")
        raise SchemaError(f"{where}: {message}" if where else message) from None
