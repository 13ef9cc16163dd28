"""One inference, from composing its sequence to closing the assistant turn.

An `Inference` is the one owner of an inference's blocks: its sequence exists before the first block
is taken, every block taken since (composition, the answer, the end of the turn) is in it, and leaving
the inference's `with` block gives back whatever was not handed over, whatever way it ends (an
answer, an error, KeyboardInterrupt, GeneratorExit). Handing over is `keep`: the answer becomes an
output chunk of the registry it is given and the sequence goes to the caller; nothing else of the
ContextManager's changes here.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from kvchat.chunks.chunk import Chunk, ChunkRegistry, KVSpan
from kvchat.chunks.compose import ComposedSequence, RepairPolicy, compose
from kvchat.chunks.placement import Placement
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import InferenceResult, ReuseMode
from kvchat.engine.block_manager import Sequence
from kvchat.engine.detokenizer import StreamDetokenizer, split_think
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate
from kvchat.engine.records import GenerationStep, PrefillProgress
from kvchat.engine.rope import KeyRotation
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.speculate import NO_SPECULATION, Speculation
from kvchat.errors import CacheFullError, ChunkError


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
    rotation: KeyRotation | None = None  # how moved keys are re-rotated; None where they cannot be


@dataclass(frozen=True)
class Answer:
    """A finished (or cancelled) answer, closed as an assistant turn, ready to be kept."""

    text: str
    token_ids: list[int]  # generation prompt + answer + end-of-turn tokens: the output chunk's tokens
    start: int  # the position of token_ids[0] in the sequence
    had_think: bool
    finish_reason: str


class Inference:
    """Compose, prefill, decode and close one answer, as the one owner of its blocks. Enter it as a
    `with` block; drive `steps()`, then `keep()` the answer (or not), then read `result()`."""

    def __init__(self, setup: Setup, placement: Placement, params: SamplingParams | None = None):
        self.setup, self.placement, self.params = setup, placement, params or SamplingParams()
        self.chunks = placement.chunks
        self.composed: ComposedSequence | None = None
        self.prompt_len = 0
        self.last: GenerationStep | None = None
        self.finish_reason = "cancelled"
        self.text: list[str] = []  # the answer's text, as the steps released it
        self.plan_s = 0.0
        self.seq: Sequence | None = None  # the context's sequence, from before its first block on
        self._holds_blocks = False  # until hand_over: leaving the `with` block frees them

    def __enter__(self) -> Inference:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """The one way out: the blocks not handed over go back, whatever ended the block."""
        if self._holds_blocks:
            assert self.seq is not None
            self.setup.engine.free(self.seq)
            self._holds_blocks = False

    def compose(self, reserve_tokens: int = 0) -> ComposedSequence:
        """The context's sequence with KV reused per the mode, room checked for `reserve_tokens` more.
        Its blocks are this inference's from the first one taken."""
        engine = self.setup.engine
        token_ids = self.placement.token_ids
        _check_room(engine, len(token_ids), reserve_tokens)
        self.seq, self._holds_blocks = engine.new_sequence(token_ids), True
        mode, rotation = self.setup.mode, self.setup.rotation
        if mode is not ReuseMode.EXACT and rotation is None:
            raise ChunkError(f"{mode} moves cached keys, which this model cannot re-rotate: use exact")
        ranges = self.placement.ranges
        self.composed = compose(engine, self.seq, ranges, mode, self.setup.repair, rotation)
        missing = -(-(len(token_ids) + reserve_tokens) // engine.block_size) - len(self.seq.block_table)
        if missing > engine.num_free_blocks:
            free = engine.num_free_blocks
            raise CacheFullError(f"KV cache full: {missing} more blocks needed for the answer, {free} free")
        return self.composed

    def steps(self) -> Generator[PrefillProgress | GenerationStep, None, None]:
        """Stream the prefill's progress and the answer. A KeyboardInterrupt (raised inside, or thrown
        in at a yield) ends it quietly: what was generated so far is the answer."""
        t0 = time.perf_counter()
        close_ids = self.setup.format.assistant_close_ids
        try:
            seq = self.compose(self.params.max_tokens + len(close_ids)).seq
            self.plan_s = time.perf_counter() - t0
            self.prompt_len = seq.num_tokens
            fmt = self.setup.format
            detok = StreamDetokenizer(
                self.setup.tokenizer, think_ids=fmt.think_ids, skip_ids=self.setup.eos_token_ids
            )
            speculation = self.setup.speculation
            steps = generate(
                self.setup.engine,
                seq,
                self.params,
                self.setup.eos_token_ids,
                detok,
                speculation if speculation.mode != "off" else None,  # off: the plain loop alone
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
                    yield step
            finally:
                steps.close()
        except KeyboardInterrupt:
            self.finish_reason = "cancelled"

    @property
    def generated_ids(self) -> list[int]:
        if self.seq is None:
            return []
        return self.seq.token_ids[self.prompt_len : self.prompt_len + self._num_generated]

    def close_turn(self) -> Answer | None:
        """End the answer with the end-of-turn tokens and compute the KV still missing, so the whole
        turn can be reused. None when nothing was generated (cancelled in the prefill)."""
        if self.last is None or not self._holds_blocks:
            return None
        engine, seq = self.setup.engine, self.seq
        assert seq is not None
        fmt = self.setup.format
        close_ids = fmt.assistant_close_ids
        generated = self.generated_ids
        if self.finish_reason == "stop" and generated and generated[-1] in close_ids:
            # the stop token is part of the closing (<|im_end|>): what follows it is added
            engine.extend(seq, close_ids[len(close_ids) - close_ids[::-1].index(generated[-1]) :])
        else:
            engine.extend(seq, close_ids)  # an unfinished answer is closed before it can be reused
        if seq.num_computed < seq.num_tokens:
            engine.compute(seq)
        start = self.prompt_len - len(fmt.generation_prompt_ids)
        _, _, had_think = split_think(generated, fmt.think_ids)
        return Answer("".join(self.text).strip(), seq.token_ids[start:], start, had_think, self.finish_reason)

    def hand_over(self) -> Sequence:
        """Give the sequence (and its block references) to the caller, who keeps it."""
        assert self.seq is not None and self._holds_blocks
        self._holds_blocks = False
        return self.seq

    def keep(self, registry: ChunkRegistry) -> tuple[Chunk, Sequence] | None:
        """Close the turn and hand it over as kept chunks: the answer becomes an output chunk of
        `registry` with its KV pinned, the chunks computed exactly get spans over it, and the sequence
        (with its block references) goes to the caller. None when nothing was generated."""
        answer = self.close_turn()
        if answer is None:
            return None  # cancelled in the prefill: what it computed stays cached
        blocks, seq = self.setup.engine.blocks, self.hand_over()
        output = registry.add_output(
            answer.text,
            answer.token_ids,
            had_think=answer.had_think,
            source_ids=tuple(c.chunk_id for c in self.placement.sources),
            finish_reason=answer.finish_reason,
        )
        exact = seq.exact_limit >= seq.num_tokens
        output.span = KVSpan.of(blocks, seq, answer.start, seq.num_tokens, exact, pinned=True)
        assert self.composed is not None
        for chunk, a, b in self.composed.chunk_ranges:
            if a < b <= seq.exact_limit and (chunk.span is None or not chunk.span.is_valid(blocks)):
                chunk.token_ids = seq.token_ids[a:b]  # a span holds the KV of its chunk's own ids
                chunk.span = KVSpan.of(blocks, seq, a, b, exact=True, pinned=False)
        return output, seq

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
            prompt_ids=self.seq.token_ids[: self.prompt_len] if self.seq else [],  # none before the prefill
        )

    @property
    def _num_generated(self) -> int:
        return self.last.stats.num_generated if self.last else 0


def _check_room(engine: Engine, num_tokens: int, reserve_tokens: int) -> None:
    limit = engine.max_positions
    if limit is not None and num_tokens + reserve_tokens > limit:
        raise CacheFullError(
            f"this context ({num_tokens} tokens) plus {reserve_tokens} for the answer is longer than the "
            f"model's {limit} positions; drop chunks or lower --max-tokens"
        )
    capacity = engine.capacity_tokens
    if num_tokens + reserve_tokens > capacity:
        raise CacheFullError(
            f"this context ({num_tokens} tokens) plus {reserve_tokens} for the answer does not fit in "
            f"the KV budget ({capacity} tokens); drop chunks or raise --kv-memory"
        )
