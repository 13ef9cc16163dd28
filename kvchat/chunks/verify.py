"""`/verify`: how much a reuse mode changed the answer, the current context in the chosen mode against
a full recompute of the same tokens. This is how a user sees whether reuse changed what the model says:
on a batch-invariant engine (Engine.batch_invariance) exact reuse gives logits identical to the bit."""

from __future__ import annotations

import torch

from kvchat.chunks.compose import ComposedSequence
from kvchat.chunks.reports import FidelityReport
from kvchat.chunks.types import ReuseMode
from kvchat.engine.engine import Engine
from kvchat.errors import CacheFullError


@torch.inference_mode()
def compare_logits(full: torch.Tensor, approx: torch.Tensor) -> tuple[float, bool, int, float]:
    """(KL(full || approx), top-1 equal, top-5 overlap, max |logit difference|) of two (V,) logits."""
    log_p = torch.log_softmax(full.float(), dim=-1)  # (V,)
    log_q = torch.log_softmax(approx.float(), dim=-1)
    kl = float((log_p.exp() * (log_p - log_q)).sum())
    top5_full = set(full.topk(5).indices.tolist())
    top5_approx = set(approx.topk(5).indices.tolist())
    top1 = int(full.argmax()) == int(approx.argmax())
    return (
        max(kl, 0.0),
        top1,
        len(top5_full & top5_approx),
        float((full.float() - approx.float()).abs().max()),
    )


def measure_fidelity(
    composed: ComposedSequence,
    engine: Engine,
    mode: ReuseMode,
    eos_token_ids: frozenset[int],
    num_tokens: int,
) -> FidelityReport:
    """Compare a composed context (whose sequence the caller owns) with a full recompute of the same
    tokens, teacher-forced over up to `num_tokens` greedy tokens: the first position whose logits differ
    in any bit, and how much the first position's differ."""
    approx_seq = composed.seq
    approx = engine.compute(approx_seq)
    try:
        # Not indexed: a later /verify or /infer measures its own mode, not this recompute.
        full_seq = engine.start(list(approx_seq.token_ids), reuse=False, index=False)
    except CacheFullError:
        raise CacheFullError(
            f"/verify needs room for a second, fully recomputed copy of the context "
            f"({approx_seq.num_blocks_needed} blocks; {engine.num_free_blocks} free): raise --kv-memory"
        ) from None
    try:
        full = engine.compute(full_seq)
        kl, top1, top5, max_diff = compare_logits(full, approx)
        # Teacher-forced: both sequences get the full recompute's greedy tokens, so every position
        # compares the two models' choices in the same context.
        agree, matches, compared, first_difference = 0, 0, 0, None
        for step in range(num_tokens):
            if first_difference is None and not torch.equal(full, approx):
                first_difference = step
            token = int(full.argmax())
            same = token == int(approx.argmax())
            compared += 1
            matches += same
            agree += same and agree == step
            if token in eos_token_ids or step + 1 == num_tokens:
                break
            for seq in (approx_seq, full_seq):
                engine.extend(seq, [token])
            approx, full = engine.compute(approx_seq), engine.compute(full_seq)
    finally:
        engine.free(full_seq)
    return FidelityReport(
        mode=mode,
        first_difference=first_difference,
        kl_divergence=kl,
        top1_agree=top1,
        top5_overlap=top5,
        max_logit_diff=max_diff,
        greedy_agree=agree,
        greedy_tokens=compared,
        top1_rate=matches / compared,
        reused_tokens=composed.num_reused,
        repositioned_tokens=composed.num_repositioned,
        computed_tokens=composed.num_prompt - composed.num_reused - composed.num_repositioned,
    )
