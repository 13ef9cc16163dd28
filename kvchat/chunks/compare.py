"""`/compare`: the current query answered under several reuse modes from the same cached chunks.

Every mode decodes greedily (the argmax of the model's logits: no temperature, no repetition penalty),
whatever the sampling settings: with the sampler out, a difference between two answers comes from the
KV alone. Nothing is kept: each mode's sequence is freed when its answer is done, no output is
retained, the live conversation is left as it was. Exact runs last, because the exact KV it computes
would otherwise be found, and shared, by the modes after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from kvchat.chunks.inference import Inference, Setup
from kvchat.chunks.placement import Placement
from kvchat.chunks.reports import Comparison, ModeAnswer
from kvchat.chunks.types import ReuseMode
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.speculate import NO_SPECULATION
from kvchat.errors import ChunkError

if TYPE_CHECKING:
    from kvchat.chunks.context import ContextManager


def compare_modes(
    cm: ContextManager,
    modes: list[ReuseMode],
    params: SamplingParams,
    on_answer: Callable[[ReuseMode, str], None] | None = None,
) -> Comparison:
    """Answer the current query under each mode (greedy, one token at a time, up to `params.max_tokens`),
    keeping nothing; `on_answer(mode, text)` hears of each answer as it is done. Without drafts, so that
    the answers differ by their KV alone even on an engine whose forward over drafts rounds otherwise
    (not batch-invariant, Engine.batch_invariance)."""
    if not cm.view_state().can_answer:
        raise ChunkError("no query to answer: set one with /query TEXT")
    modes = runnable_modes(cm, modes)
    greedy = replace(params, temperature=0.0, repetition_penalty=1.0)
    setup, placement = cm.setup, cm.placement()
    order = sorted(dict.fromkeys(modes), key=lambda m: m is ReuseMode.EXACT)
    runs = {}
    for mode in order:
        runs[mode] = answer_once(replace(setup, mode=mode, speculation=NO_SPECULATION), placement, greedy)
        if on_answer is not None:
            on_answer(mode, runs[mode][1])
    reference = ReuseMode.EXACT if ReuseMode.EXACT in runs else modes[0]
    ref_ids = runs[reference][0]
    results = []
    for mode in dict.fromkeys(modes):
        token_ids, text, ttft, reused, moved, computed = runs[mode]
        diff = first_difference(ref_ids, token_ids)
        char = None if diff is None else _text_length(setup.tokenizer, token_ids[:diff], text)
        results.append(
            ModeAnswer(
                mode,
                text,
                token_ids,
                ttft,
                reused,
                moved,
                computed,
                diff,
                char,
                agreement(ref_ids, token_ids),
            )
        )
    return Comparison(reference, results)


def runnable_modes(cm: ContextManager, modes: list[ReuseMode]) -> list[ReuseMode]:
    """The modes this model can run: where its keys cannot be re-rotated, exact alone (ChunkError when
    none is left)."""
    if not modes:
        raise ChunkError("no mode to compare")
    reason = getattr(cm, "move_refusal", None)
    kept = [m for m in modes if m is ReuseMode.EXACT or reason is None]
    if not kept:
        raise ChunkError(f"{' and '.join(dict.fromkeys(modes))} cannot run on this model: {reason}")
    return kept


def answer_once(
    setup: Setup, placement: Placement, params: SamplingParams
) -> tuple[list[int], str, float, int, int, int]:
    """(token ids, text, ttft, reused, repositioned, computed) of one answer under `setup.mode`; its
    sequence is freed."""
    with Inference(setup, placement, params) as run:
        for _ in run.steps():
            pass
    result = run.result(None)
    if result.finish_reason == "cancelled":
        raise ChunkError(f"/compare cancelled during {setup.mode}")
    token_ids = [t for t in result.token_ids if t not in setup.eos_token_ids]
    return (
        token_ids,
        result.text,
        result.ttft_s,
        result.reused_tokens,
        result.repositioned_tokens,
        result.computed_tokens,
    )


def first_difference(reference: list[int], other: list[int]) -> int | None:
    """The first index where the two token lists differ (one ending first counts); None if equal."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def agreement(reference: list[int], other: list[int]) -> float:
    """Share of positions (of the longer answer) holding the same token in both."""
    longest = max(len(reference), len(other))
    if not longest:
        return 1.0
    return sum(a == b for a, b in zip(reference, other, strict=False)) / longest


def _text_length(tokenizer, token_ids: list[int], text: str) -> int:
    prefix = tokenizer.decode(token_ids, skip_special_tokens=True).strip()
    return min(len(prefix), len(text))
