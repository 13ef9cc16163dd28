"""The token loop: prefill, then decode one token at a time, streamed as small records."""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass

import torch

from kvchat.engine.detokenizer import StreamDetokenizer
from kvchat.engine.engine import Engine
from kvchat.engine.records import PrefillProgress
from kvchat.engine.sampling import SamplingParams, make_sampler
from kvchat.engine.sequence import Sequence


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    reused_tokens: int  # prompt tokens whose KV was already in the cache
    computed_tokens: int  # prompt tokens computed by the prefill
    num_generated: int
    ttft_s: float  # from the start of the prefill to the first sampled token
    prefill_s: float
    decode_s: float

    @property
    def prefill_tok_s(self) -> float:
        return self.computed_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        steps = self.num_generated - 1  # the first token comes from the prefill
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class GenerationStep:
    token_id: int
    text: str  # answer text that became final with this token
    thinking: str  # thinking text that became final with this token
    finish_reason: str | None  # set on the last step: "stop", "stop_string" or "length"
    stats: GenerationStats


class StopStrings:
    """Holds back text that could be the start of a stop string, and reports when one appears."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(s for s in stop if s)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found)."""
        if not self.stop:
            return text, False
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        cut = max(0, len(self.pending) - self.holdback)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def generate(
    engine: Engine,
    seq: Sequence,
    params: SamplingParams,
    eos_token_ids: frozenset[int],
    detokenizer: StreamDetokenizer,
) -> Generator[PrefillProgress | GenerationStep, None, None]:
    """Sample up to `params.max_tokens` tokens after the sequence's tokens, appending them to it.

    The last sampled token is appended without its KV (nothing reads it unless the caller computes
    it). Closing the generator stops it within one token; the sequence stays consistent.
    """
    sampler = make_sampler(params, engine.device)
    stops = StopStrings(params.stop)
    prompt_tokens, reused = seq.num_tokens, seq.num_computed
    use_seen = params.repetition_penalty != 1.0
    seen = torch.tensor(seq.token_ids, device=engine.device) if use_seen else None  # (T,)
    t0 = time.perf_counter()
    while seq.num_tokens - seq.num_computed > engine.prefill_chunk:
        engine.compute(seq, until=seq.num_computed + engine.prefill_chunk)
        yield PrefillProgress(seq.num_computed - reused, prompt_tokens - reused)
    logits = engine.compute(seq)  # (V,)
    t_prefill = time.perf_counter() - t0
    ttft = decode_s = 0.0
    for n in range(1, params.max_tokens + 1):
        t_step = time.perf_counter()
        token = sampler.sample(logits, seen)
        if n == 1:
            ttft = time.perf_counter() - t0
            t_step = t0 + ttft  # decode time starts after the first token
        engine.extend(seq, [token])
        finish = "stop" if token in eos_token_ids else None
        text, thinking = detokenizer.add(token)
        text, hit = stops.feed(text)
        if hit:
            finish = "stop_string"
        elif finish is None and n == params.max_tokens:
            finish = "length"
        if finish is not None:
            tail_text, tail_thinking = detokenizer.finish()
            if finish != "stop_string":
                text += stops.feed(tail_text)[0] + stops.flush()
            thinking += tail_thinking
        else:
            if seen is not None:
                seen = torch.cat([seen, torch.tensor([token], device=engine.device)])
            logits = engine.compute(seq)
        decode_s += time.perf_counter() - t_step  # the consumer's time between steps is not counted
        stats = GenerationStats(prompt_tokens, reused, prompt_tokens - reused, n, ttft, t_prefill, decode_s)
        yield GenerationStep(token, text, thinking, finish, stats)
        if finish is not None:
            return
