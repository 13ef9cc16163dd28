"""The records of the cache views that need the model to compute (/attention, /compare): plain data,
importable without torch, so the CLI can name them before a model is loaded."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvchat.chunks.types import ReuseMode


@dataclass(frozen=True)
class ChunkAttention:
    chunk_id: str | None  # None for the sink tokens
    role: str  # a chunk role, "sink", or "answer" (the answer's own tokens and its turn's opening)
    number: int | None
    num_tokens: int
    attention_share: float  # averaged over layers, heads and generated tokens
    by_layer_group: dict[str, float]


@dataclass(frozen=True)
class AttentionReport:
    output_number: int
    num_queries: int  # the positions whose next token the answer is made of
    num_layers: int
    over_live_kv: bool  # read over the KV the inference used (else over exact KV of its context)
    chunks: list[ChunkAttention]
    token_weights: list[float] = field(default_factory=list)  # mean share of every position
    positions: dict[str, tuple[int, int]] = field(default_factory=dict)  # chunk id -> [start, end)

    def heat(self, chunk_id: str) -> list[float] | None:
        """The attention share of each token of a chunk of this context; None if not in it."""
        if chunk_id not in self.positions:
            return None
        start, end = self.positions[chunk_id]
        return self.token_weights[start:end]


@dataclass(frozen=True)
class ModeAnswer:
    """One mode's greedy answer and what it cost."""

    mode: ReuseMode
    output: str
    token_ids: list[int]
    ttft_s: float
    reused_tokens: int
    repositioned_tokens: int
    computed_tokens: int
    first_difference: int | None  # first token index differing from the reference; None: identical
    first_difference_char: int | None  # where that token's text starts in `output`
    agreement: float  # share of token positions equal to the reference's


@dataclass(frozen=True)
class Comparison:
    reference: ReuseMode  # exact when compared, else the first mode named
    results: list[ModeAnswer]
