"""One inference, from composing its sequence to closing the assistant turn.

An `Inference` owns its sequence from the moment it is composed until the ContextManager adopts it as
the live sequence; `release` frees whatever it still holds, so a caller that runs it under
`try/finally` leaks nothing on any way out (return, error, KeyboardInterrupt, GeneratorExit). It
changes no ContextManager state: it returns records, and the ContextManager keeps what it wants.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from kvchat.chunks.compose import ComposedSequence, RepairPolicy, compose
from kvchat.chunks.registry import Chunk
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import InferenceResult, ReuseMode, StepEvent
from kvchat.engine.detokenizer import StreamDetokenizer, split_think
from kvchat.engine.engine import Engine
from kvchat.engine.generate import GenerationStep, PrefillProgress, generate
from kvchat.engine.rope import rotary_inv_freq
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.sequence import Sequence
from kvchat.engine.speculate import NO_SPECULATION, Speculation
from kvchat.errors import CacheFullError


@dataclass(frozen=True)
class Setup:
    """What every inference of a session shares."""

    engine: Engine
    format: ChatFormat
    tokenizer: Any
    eos_token_ids: frozenset[int]
    mode: ReuseMode
    repair: RepairPolicy
    speculation: Speculation = NO_SPECULATION


@dataclass(frozen=True)
class Answer:
    """A finished (or cancelled) answer, closed as an assistant turn, ready to be kept."""

    text: str
    token_ids: list[int]  # generation prompt + answer + end-of-turn tokens: the output chunk's tokens
    start: int  # the position of token_ids[0] in the sequence
    had_think: bool
    finish_reason: str


def build(setup: Setup, chunks: list[Chunk], reserve_tokens: int = 0) -> ComposedSequence:
    """The context's sequence with KV reused per the mode, room checked for `reserve_tokens` more.
    The caller owns the returned sequence (free it, or hand it on)."""
    engine = setup.engine
    gen_ids = setup.format.generation_prompt_ids()
    num_tokens = sum(len(c.token_ids) for c in chunks) + len(gen_ids)
    limit = engine.max_positions
    if limit is not None and num_tokens + reserve_tokens > limit:
        raise CacheFullError(
            f"this context ({num_tokens} tokens) plus {reserve_tokens} for the answer is longer than the "
            f"model's {limit} positions; drop chunks or lower --max-tokens"
        )
    capacity = engine.blocks.num_blocks * engine.block_size
    if num_tokens + reserve_tokens > capacity:
        raise CacheFullError(
            f"this context ({num_tokens} tokens) plus {reserve_tokens} for the answer does not fit in "
            f"the KV budget ({capacity} tokens); drop chunks or raise --kv-memory"
        )
    inv_freq = rotary_inv_freq(engine.model) if setup.mode is not ReuseMode.EXACT else None
    composed = compose(engine, chunks, gen_ids, setup.mode, setup.repair, inv_freq)
    missing = -(-(num_tokens + reserve_tokens) // engine.block_size) - len(composed.seq.block_table)
    if missing > engine.blocks.num_free:
        free = engine.blocks.num_free
        engine.free(composed.seq)
        raise CacheFullError(f"KV cache full: {missing} more blocks needed for the answer, {free} free")
    return composed


class Inference:
    """Compose, prefill, decode and close one answer. Drive `steps()`, then `close_turn()`, then
    `result()`; call `release()` in a `finally`."""

    def __init__(
        self,
        setup: Setup,
        chunks: list[Chunk],
        params: SamplingParams,
        compose: Callable[[list[Chunk], int], ComposedSequence] | None = None,
    ):
        self.setup, self.chunks, self.params = setup, chunks, params
        self._compose = compose or (lambda chunks, reserve: build(setup, chunks, reserve))
        self.composed: ComposedSequence | None = None
        self.prompt_len = 0
        self.last: GenerationStep | None = None
        self.finish_reason = "cancelled"
        self.text: list[str] = []
        self.plan_s = 0.0
        self._owned: Sequence | None = None  # the sequence while this inference holds its blocks

    def steps(self) -> Generator[PrefillProgress | StepEvent, None, None]:
        """Stream the prefill's progress and the answer. A KeyboardInterrupt (raised inside, or thrown
        in at a yield) ends it quietly: what was generated so far is the answer."""
        t0 = time.perf_counter()
        close_ids = self.setup.format.assistant_close_ids()
        try:
            self.composed = self._compose(self.chunks, self.params.max_tokens + len(close_ids))
            self._owned = seq = self.composed.seq
            self.plan_s = time.perf_counter() - t0
            self.prompt_len = seq.num_tokens
            fmt = self.setup.format
            detok = StreamDetokenizer(
                self.setup.tokenizer, think_ids=fmt.think_ids, skip_ids=self.setup.eos_token_ids
            )
            steps = generate(
                self.setup.engine, seq, self.params, self.setup.eos_token_ids, detok, self.setup.speculation
            )
            try:
                for step in steps:
                    if isinstance(step, PrefillProgress):
                        yield step
                        continue
                    self.last = step
                    self.text.append(step.text)
                    if step.finish_reason:
                        self.finish_reason = step.finish_reason
                    yield StepEvent(step.text, step.thinking, step.token_id, step.stats.num_generated)
            finally:
                steps.close()
        except KeyboardInterrupt:
            self.finish_reason = "cancelled"

    @property
    def generated_ids(self) -> list[int]:
        seq = self._seq
        return [] if seq is None else seq.token_ids[self.prompt_len : self.prompt_len + self._num_generated]

    def close_turn(self) -> Answer | None:
        """End the answer with the end-of-turn tokens and compute the KV still missing, so the whole
        turn can be reused. None when nothing was generated (cancelled in the prefill)."""
        if self.last is None or self._owned is None:
            return None
        engine, seq = self.setup.engine, self._owned
        fmt = self.setup.format
        close_ids = fmt.assistant_close_ids()
        generated = self.generated_ids
        if self.finish_reason == "stop" and generated and generated[-1] == close_ids[0]:
            engine.extend(seq, close_ids[1:])
        else:
            engine.extend(seq, close_ids)  # an unfinished answer is closed before it can be reused
        if seq.num_computed < seq.num_tokens:
            engine.compute(seq)
        start = self.prompt_len - len(fmt.generation_prompt_ids())
        _, _, had_think = split_think(generated, fmt.think_ids)
        return Answer("".join(self.text).strip(), seq.token_ids[start:], start, had_think, self.finish_reason)

    def adopt(self) -> Sequence:
        """Hand the sequence (and its block references) to the caller."""
        seq, self._owned = self._owned, None
        assert seq is not None
        return seq

    def release(self) -> None:
        """Free the sequence unless it was adopted."""
        if self._owned is not None:
            self.setup.engine.free(self._owned)
            self._owned = None

    def result(self, output: Chunk | None) -> InferenceResult:
        composed = self.composed
        stats = self.last.stats if self.last else None
        reports = composed.reports() if composed else []
        return InferenceResult(
            text=output.text if output else "".join(self.text).strip(),
            token_ids=self.generated_ids,
            finish_reason=self.finish_reason,
            output_number=output.output_number if output else None,
            chunk_id=output.chunk_id if output else None,
            mode=self.setup.mode,
            prompt_tokens=self.prompt_len,
            reused_tokens=composed.num_reused if composed else 0,
            repositioned_tokens=composed.num_repositioned if composed else 0,
            computed_tokens=sum(r.num_computed for r in reports),
            ttft_s=self.plan_s + (stats.ttft_s if stats else 0.0),
            prefill_tok_s=stats.prefill_tok_s if stats else 0.0,
            decode_tok_s=stats.decode_tok_s if stats else 0.0,
            chunks=reports,
            had_think=output.had_think if output else False,
            drafted_tokens=stats.drafted_tokens if stats else 0,
            accepted_tokens=stats.accepted_tokens if stats else 0,
        )

    @property
    def _seq(self) -> Sequence | None:
        return self.composed.seq if self.composed else None

    @property
    def _num_generated(self) -> int:
        return self.last.stats.num_generated if self.last else 0
