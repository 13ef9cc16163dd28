"""The records the token loop streams, read as they are up to the screen; plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillProgress:
    """A prompt longer than one prefill piece reports each piece before the first token."""

    done: int  # prompt tokens computed so far by this prefill
    total: int  # prompt tokens this prefill computes


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    reused_tokens: int  # prompt tokens whose KV was already in the cache
    computed_tokens: int  # prompt tokens computed by the prefill
    num_generated: int
    ttft_s: float  # from the start of the prefill to the first sampled token
    prefill_s: float
    decode_s: float
    drafted_tokens: int = 0  # tokens proposed by speculative drafting
    accepted_tokens: int = 0  # drafted tokens the model accepted

    @property
    def prefill_tok_s(self) -> float:
        return self.computed_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        steps = self.num_generated - 1  # the first token comes from the prefill
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class GenerationStep:
    """One sampled token of an answer, built once by the token loop and read as it is by every level
    above it, the screen included."""

    token_id: int
    text: str  # answer text that became final with this token (UTF-8 safe, think spans excluded)
    thinking: str  # thinking text that became final with this token
    finish_reason: str | None  # set on the last step: "stop", "stop_string" or "length"
    stats: GenerationStats

    @property
    def num_generated(self) -> int:
        return self.stats.num_generated
