"""What the measuring commands report: /verify (a mode against a full recompute), /attention (where the
last answer looked) and /compare (the query answered under each mode). Plain data: the CLI renders
them, tests inspect them."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvchat.chunks.types import ReuseMode


@dataclass(frozen=True)
class FidelityReport:
    """A chosen reuse mode compared with a full recompute of the same context."""

    mode: ReuseMode
    first_difference: int | None  # the first compared position whose logits differ in a bit; None: none
    kl_divergence: float  # KL(full || mode) of the next-token distribution
    top1_agree: bool
    top5_overlap: int  # of 5
    max_logit_diff: float
    greedy_agree: int  # leading greedy tokens equal before the first difference
    greedy_tokens: int  # positions compared (N, or fewer when the answer ended)
    top1_rate: float  # share of compared positions whose top-1 token agrees (teacher-forced)
    reused_tokens: int
    repositioned_tokens: int
    computed_tokens: int

    @property
    def identical(self) -> bool:
        """Whether the logits were bitwise equal at every compared position."""
        return self.first_difference is None


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
