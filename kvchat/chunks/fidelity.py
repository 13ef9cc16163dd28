"""How much a reuse mode changed the answer: the current context in the chosen mode against a full
recompute of the same tokens. This is how a user sees whether reuse changed what the model says."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvchat.chunks.inference import build
from kvchat.chunks.types import FidelityReport
from kvchat.errors import CacheFullError, ChunkError

if TYPE_CHECKING:
    from kvchat.chunks.context import ContextManager


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


def verify(cm: ContextManager, num_tokens: int) -> FidelityReport:
    """Compare the manager's mode with a full recompute on the current context."""
    if cm.query is None and not cm.turns:
        raise ChunkError("nothing to verify: set a query with /query TEXT")
    if num_tokens < 1:
        raise ChunkError("verify needs at least 1 token to compare")
    engine = cm.engine
    chunks = cm.context_chunks()
    composed = build(cm, chunks, reserve_tokens=num_tokens, release_live=False)
    approx_seq = composed.seq
    full_seq = None
    try:
        approx = engine.compute(approx_seq)
        try:
            full_seq = engine.start(list(approx_seq.token_ids), reuse=False)
        except CacheFullError:
            raise CacheFullError(
                f"/verify needs room for a second, fully recomputed copy of the context "
                f"({approx_seq.num_blocks_needed} blocks; {engine.blocks.num_free} free): raise --kv-memory"
            ) from None
        full = engine.compute(full_seq)
        kl, top1, top5, max_diff = compare_logits(full, approx)
        # Teacher-forced: both sequences get the full recompute's greedy tokens, so every position
        # compares the two models' choices in the same context.
        agree, matches, compared = 0, 0, 0
        for step in range(num_tokens):
            token = int(full.argmax())
            same = token == int(approx.argmax())
            compared += 1
            matches += same
            agree += same and agree == step
            if token in cm.eos_token_ids or step + 1 == num_tokens:
                break
            for seq in (approx_seq, full_seq):
                engine.extend(seq, [token])
            approx, full = engine.compute(approx_seq), engine.compute(full_seq)
    finally:
        engine.free(approx_seq)
        if full_seq is not None:
            engine.free(full_seq)
    prompt_len = sum(len(c.token_ids) for c in chunks) + len(cm.format.generation_prompt_ids())
    return FidelityReport(
        mode=cm.mode,
        kl_divergence=kl,
        top1_agree=top1,
        top5_overlap=top5,
        max_logit_diff=max_diff,
        greedy_agree=agree,
        greedy_tokens=compared,
        top1_rate=matches / compared,
        reused_tokens=composed.num_reused,
        repositioned_tokens=composed.num_repositioned,
        computed_tokens=prompt_len - composed.num_reused - composed.num_repositioned,
    )
