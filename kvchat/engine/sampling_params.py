"""How the next token is chosen and when generation stops: the engine's record, plain data (no torch).

The application declares these fields as settings (help, flags, the ranges `/set` reports) in
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
