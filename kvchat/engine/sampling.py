"""Sampling settings and the one sampler built from them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen, and when generation stops.

    temperature 0 means greedy. top_k 0, top_p 1.0, min_p 0.0 and repetition_penalty 1.0 are off.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = ()
