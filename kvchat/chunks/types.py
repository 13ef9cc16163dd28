"""The chunk layer's vocabulary and records: roles and reuse modes, a chunk as the user sees it
(/chunks, /show, /stats), and what an inference did (its result, per chunk). Plain data."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from enum import StrEnum

from kvchat.engine.records import GenerationStep, PrefillProgress


class Role(StrEnum):
    """What a chunk is. A conversation's assistant turns are OUTPUT chunks: every answer is kept."""

    SYSTEM = "system"
    CONTEXT = "context"
    QUERY = "query"
    OUTPUT = "output"
    USER = "user"


class ReuseMode(StrEnum):
    EXACT = "exact"
    REPOSITION = "reposition"
    REPAIR = "repair"


class RepairStrategy(StrEnum):
    """Which moved tokens repair recomputes: each moved chunk's first ones (EPIC), or the ones whose KV
    deviates most from a forward in the new context (CacheBlend)."""

    PREFIX = "prefix"
    DEVIATION = "deviation"


@dataclass(frozen=True)
class ChunkInfo:
    """One registered chunk as the user sees it."""

    number: int  # 1-based, stable for the session
    chunk_id: str  # short content hash
    role: Role
    text: str
    num_tokens: int
    num_blocks: int  # blocks holding this chunk's KV now (0: no KV kept)
    num_refs: int  # references on those blocks
    place: int | None  # 1-based position in the current context, None if not in it
    pinned: bool
    output_number: int | None = None  # set for retained outputs
    finish_reason: str | None = None  # for outputs: "stop", "stop_string", "length", "cancelled"

    @property
    def truncated(self) -> bool:
        """An output cut short: by the token limit or by Ctrl-C."""
        return self.finish_reason in ("length", "cancelled")


@dataclass(frozen=True)
class ChunkReport:
    """What one inference did with one chunk of its context; the generation prompt after the chunks
    (the template's assistant header) is a last row with no chunk id and no role."""

    chunk_id: str | None
    role: Role | None
    num_tokens: int
    num_reused: int  # KV used as is (exact prefix hit)
    num_repositioned: int  # KV re-rotated to new positions
    num_computed: int
    num_recomputed: int = 0  # of those computed, tokens whose moved KV repair replaced


@dataclass(frozen=True)
class InferenceResult:
    """The end of an inference: what was generated and what it cost."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS), "stop_string", "length", "cancelled"
    output_number: int | None
    chunk_id: str | None
    mode: ReuseMode
    prompt_tokens: int
    reused_tokens: int
    repositioned_tokens: int
    computed_tokens: int
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    chunks: list[ChunkReport] = field(default_factory=list)
    had_think: bool = False
    drafted_tokens: int = 0  # tokens proposed by speculative decoding
    accepted_tokens: int = 0  # of those, the ones the model accepted
    prompt_ids: list[int] = field(default_factory=list)  # the prompt as the model read it; token_ids follow

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


# An inference as it streams: the prefill's progress, each step, then the InferenceResult. A generator,
# so that Ctrl-C can be thrown into it.
InferenceStream = Generator[PrefillProgress | GenerationStep | InferenceResult, None, None]


@dataclass(frozen=True)
class CacheStats:
    num_blocks: int
    num_used: int  # referenced by a live sequence or chunk
    num_pinned: int
    num_cached: int  # unreferenced but holding reusable KV
    num_free: int
    block_size: int
    bytes_total: int
    bytes_per_block: int
    hit_tokens: int
    lookup_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


@dataclass(frozen=True)
class ChunkDetail:
    """Everything `/show` tells about one chunk."""

    info: ChunkInfo
    token_ids: list[int]
    positions: range | None  # token positions in the current context, None if not in it
    kv_positions: range | None  # positions its kept KV was computed at, None if no KV kept
    block_ids: list[int]  # blocks holding its kept KV
    had_think: bool = False
    source: str | None = None  # for outputs: the chunk ids of the context it came from
