"""One inference of the ContextManager: compose, generate, close the turn, retain the output."""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import TYPE_CHECKING

from kvchat.chunks.compose import ComposedSequence, compose
from kvchat.chunks.registry import Chunk
from kvchat.chunks.spans import KVSpan
from kvchat.chunks.types import InferenceResult, StepEvent
from kvchat.engine.detokenizer import StreamDetokenizer, split_think
from kvchat.engine.generate import GenerationStep, PrefillProgress, generate
from kvchat.engine.rope import rotary_inv_freq
from kvchat.engine.sampling import SamplingParams
from kvchat.errors import CacheFullError

if TYPE_CHECKING:
    from kvchat.chunks.context import ContextManager


def build(
    cm: ContextManager, chunks: list[Chunk], reserve_tokens: int = 0, release_live: bool = True
) -> ComposedSequence:
    """The context's sequence with KV reused per the manager's mode, room checked for the answer."""
    if release_live:
        cm._release_live()  # its blocks stay cached, so the new sequence can still share them
    gen_ids = cm.format.generation_prompt_ids()
    num_tokens = sum(len(c.token_ids) for c in chunks) + len(gen_ids)
    engine = cm.engine
    capacity = engine.blocks.num_blocks * engine.block_size
    if num_tokens + reserve_tokens > capacity:
        raise CacheFullError(
            f"this context ({num_tokens} tokens) plus {reserve_tokens} for the answer does not fit in "
            f"the KV budget ({capacity} tokens); drop chunks or raise --kv-memory"
        )
    inv_freq = rotary_inv_freq(engine.model) if cm.mode.value != "exact" else None
    try:
        composed = compose(engine, chunks, gen_ids, cm.mode, cm.repair, inv_freq)
    except CacheFullError as err:
        raise CacheFullError(f"{err}. {_what_to_delete(cm)}") from None
    missing = -(-(num_tokens + reserve_tokens) // engine.block_size) - len(composed.seq.block_table)
    if missing > engine.blocks.num_free:
        engine.free(composed.seq)
        raise CacheFullError(
            f"KV cache full: {missing} more blocks needed for the answer, {engine.blocks.num_free} free. "
            + _what_to_delete(cm)
        )
    return composed


def _what_to_delete(cm: ContextManager) -> str:
    kept = [(c.output_number, len(c.span.block_ids)) for c in cm.registry.outputs() if c.span is not None]
    if not kept:
        return "Nothing is kept that could be deleted; raise --kv-memory or lower --max-tokens."
    listed = ", ".join(f"/delete-output {number} ({blocks} blocks)" for number, blocks in kept)
    return f"Kept outputs that could be deleted: {listed}"


def run(
    cm: ContextManager, chunks: list[Chunk], params: SamplingParams, turn: Chunk | None = None
) -> Generator[PrefillProgress | StepEvent | InferenceResult, None, None]:
    """Stream one inference. KeyboardInterrupt (raised inside, or thrown in at a yield) stops it
    within a token (or prefill piece); what was generated is kept and the InferenceResult still
    comes last. Cancelled before its first token, it keeps no output."""
    close_ids = cm.format.assistant_close_ids()
    t0 = time.perf_counter()
    composed = build(cm, chunks, reserve_tokens=params.max_tokens + len(close_ids))
    plan_s = time.perf_counter() - t0
    seq = composed.seq
    prompt_len = seq.num_tokens
    detok = StreamDetokenizer(cm.tokenizer, think_ids=cm.format.think_ids, skip_ids=cm.eos_token_ids)
    last: GenerationStep | None = None
    finish = "cancelled"
    text: list[str] = []
    steps = generate(cm.engine, seq, params, cm.eos_token_ids, detok, cm.speculation)
    try:
        for step in steps:
            if isinstance(step, PrefillProgress):
                yield step
                continue
            last = step
            text.append(step.text)
            if step.finish_reason:
                finish = step.finish_reason
            yield StepEvent(step.text, step.thinking, step.token_id, step.stats.num_generated)
    except KeyboardInterrupt:
        steps.close()
    except GeneratorExit:
        steps.close()
        _settle(cm, composed, chunks, prompt_len, None if last is None else "cancelled", "".join(text), turn)
        raise
    generated = seq.token_ids[prompt_len:]  # before the turn is closed
    computed = min(seq.num_computed, prompt_len) - composed.num_reused - composed.num_repositioned
    result = _settle(cm, composed, chunks, prompt_len, None if last is None else finish, "".join(text), turn)
    stats = last.stats if last else None
    yield InferenceResult(
        text=result.text if result else "",
        token_ids=generated,
        finish_reason=finish,
        output_number=result.output_number if result else None,
        chunk_id=result.chunk_id if result else None,
        mode=cm.mode,
        prompt_tokens=prompt_len,
        reused_tokens=composed.num_reused,
        repositioned_tokens=composed.num_repositioned,
        computed_tokens=computed,
        ttft_s=plan_s + (stats.ttft_s if stats else 0.0),
        prefill_tok_s=stats.prefill_tok_s if stats else 0.0,
        decode_tok_s=stats.decode_tok_s if stats else 0.0,
        chunks=composed.reports(),
        had_think=result.had_think if result else False,
        drafted_tokens=stats.drafted_tokens if stats else 0,
        accepted_tokens=stats.accepted_tokens if stats else 0,
    )


def _settle(cm, composed, chunks, prompt_len, finish: str | None, text, turn) -> Chunk | None:
    """Close the assistant turn, compute the KV still missing, and retain the output. With no
    token generated (`finish` None: cancelled in the prefill) nothing is kept; what the prefill
    computed stays cached."""
    engine, seq = cm.engine, composed.seq
    if finish is None:
        engine.free(seq)
        return None
    close_ids = cm.format.assistant_close_ids()
    generated = seq.token_ids[prompt_len:]
    if finish == "stop" and generated and generated[-1] == close_ids[0]:
        engine.extend(seq, close_ids[1:])
    else:
        engine.extend(seq, close_ids)  # an unfinished answer is closed before it can be reused
    if seq.num_computed < seq.num_tokens:
        engine.compute(seq)
    _, _, had_think = split_think(generated, cm.format.think_ids)
    start = prompt_len - len(cm.format.generation_prompt_ids())
    exact = seq.exact_limit >= seq.num_tokens
    output = cm.registry.add_output(
        text.strip(),
        seq.token_ids[start:],
        had_think=had_think,
        source_ids=tuple(c.chunk_id for c in chunks),
    )
    if output.span is None or not output.span.is_valid(engine.blocks):
        output.span = KVSpan.of(engine.blocks, seq, start, seq.num_tokens, exact, pinned=True)
    for chunk, a, b in composed.chunk_ranges:
        if b <= seq.exact_limit and (chunk.span is None or not chunk.span.is_valid(engine.blocks)):
            chunk.span = KVSpan.of(engine.blocks, seq, a, b, exact=True, pinned=False)
    if turn is not None:
        cm.turns += [turn.chunk_id, output.chunk_id]
    cm.live = seq
    return output
