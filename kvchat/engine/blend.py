"""Selective recompute (CacheBlend, Yao et al. 2025): after moved KV is placed, recompute only the
positions whose KV deviates most from what a forward in the new context computes.

The region from the first moved position to the last computed one runs through the first layers in
full (`probe_layer` + 1 of them), which makes those layers' KV exact there and, at the probe layer,
measures each position's deviation (keys and values) from the moved KV. Only the most deviating
positions, and the ones that must be computed anyway, go on through the next layer, at their own
positions, attending to everything before them; the others keep their moved KV from there on. The
selection is made again after every later layer, among the positions still running, as long as the
schedule asks for fewer of them (progressive filtering); a flat schedule selects once.
"""

from __future__ import annotations

import torch

from kvchat.engine.block_manager import Sequence
from kvchat.engine.engine import Engine
from kvchat.engine.forward_cache import SelectiveCache, cache_argument
from kvchat.engine.paged_attention import PagedKV
from kvchat.engine.rope import layer_position_embeddings


@torch.inference_mode()
def recompute_selected(
    engine: Engine, seq: Sequence, start: int, forced: list[bool], schedule: list[int], probe_layer: int
) -> list[list[int]]:
    """Recompute positions start..seq.num_computed-1 as above: layers 0..probe_layer over all of them,
    then layer probe_layer + 1 + j over those `forced` (index i is position start + i) and the
    `schedule[j]` others that deviate most (non-increasing). Returns the positions run through each
    layer after the probe layer."""
    end = seq.num_computed
    assert len(forced) == end - start and 0 <= probe_layer < engine.num_layers
    assert len(schedule) == engine.num_layers - 1 - probe_layer
    assert all(a >= b for a, b in zip(schedule, schedule[1:], strict=False)), schedule
    assert seq.exact_limit <= start, "selective recompute never writes over exact KV"
    base = getattr(engine.model, "model", engine.model)
    narrowing = [probe_layer] + [
        probe_layer + j for j in range(1, len(schedule)) if schedule[j] < schedule[j - 1]
    ]  # the layers after which fewer positions go on
    kv = PagedKV(engine.pool)
    cache = SelectiveCache(kv, engine.num_layers, end, set(narrowing))
    positions = torch.arange(start, end, device=engine.device)  # (n,)
    must = torch.tensor(forced, dtype=torch.bool, device=engine.device)  # (n,)
    num_forced = int(must.sum())
    hidden = base.embed_tokens(_tensor(seq.token_ids[start:end], engine.device).unsqueeze(0))  # (1, n, d)
    ran: list[list[int]] = []
    for index, layer in enumerate(base.layers):
        kv.bind(_tensor(seq.slots_at(positions.tolist()), engine.device), seq.block_table, end)
        cache.deviation = None
        position_ids = positions.unsqueeze(0)  # (1, q)
        window = getattr(layer.self_attn, "sliding_window", None)  # a sliding-window layer's span
        out = layer(
            hidden,
            attention_mask=_causal_mask(positions, end, hidden.dtype, window),
            position_ids=position_ids,
            **cache_argument(layer, cache),
            use_cache=True,
            position_embeddings=layer_position_embeddings(base, hidden, position_ids)[index],
        )
        hidden = out[0] if isinstance(out, tuple) else out  # (1, q, d)
        if index < probe_layer or index == engine.num_layers - 1:
            continue
        count = min(len(positions), num_forced + schedule[index - probe_layer])
        if count < len(positions):
            assert cache.deviation is not None
            score = cache.deviation.masked_fill(must, float("inf"))  # (q,)
            keep = score.topk(count).indices.sort().values  # (k,)
            hidden, positions, must = hidden[:, keep], positions[keep], must[keep]  # (1, k, d), (k,), (k,)
        ran.append(positions.tolist())
    return ran


def _causal_mask(
    positions: torch.Tensor, length: int, dtype: torch.dtype, window: int | None = None
) -> torch.Tensor:
    """Additive mask: the query at position p sees keys 0..p, or on a sliding-window layer the last
    `window` of them. (1, 1, q, length)"""
    keys = torch.arange(length, device=positions.device)  # (length,)
    allowed = keys.unsqueeze(0) <= positions.unsqueeze(1)  # (q, length)
    if window:
        allowed &= keys.unsqueeze(0) > positions.unsqueeze(1) - window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def _tensor(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
