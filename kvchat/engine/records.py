"""The engine's records, plain data (no torch): how the next token is chosen (SamplingParams, in) and
what the token loop streams up to the screen (PrefillProgress, GenerationStep, GenerationStats, out).

The application declares the sampling fields as settings (help, flags, the ranges `/set` reports) in
kvchat.settings_schema, with the defaults below; the sampler checks the values it can run on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k 0, top_p 1.0, min_p 0.0 and repetition_penalty 1.0 are off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 256
    seed: int | None = None  # None: a fresh seed each run
    stop: tuple[str, ...] = ()  # strings that end an answer
    ignore_eos: bool = False  # run to max_tokens: no end-of-turn token is sampled, no stop string ends it

    def problem(self) -> str | None:
        """Why the sampler cannot run these values, or None."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                return f"{f.name} = {value!r} must be a finite number"
        rules = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.seed is None or 0 <= self.seed < 2**64, "seed must be in [0, 2**64)"),
            (all(self.stop), "stop strings must not be empty"),
        ]
        return next((message for ok, message in rules if not ok), None)


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
