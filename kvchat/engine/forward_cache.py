"""The transformers cache a module forward is given: each layer's `update` writes the new K/V into
the paged pool through `PagedKV` (paged_attention.py) and returns the sequence's K/V from there.
`ForwardCache` serves a prefill; `SelectiveCache` a forward over some positions of a sequence the pool
already holds (selective recompute), measuring how far the new K/V lie from the old."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvchat.engine.paged_attention import PagedKV


class _PagedLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, cache: ForwardCache | SelectiveCache, layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.cache.update_layer(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.start + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.start

    def get_max_length(self) -> int:
        return -1


def cache_argument(module: torch.nn.Module, cache: Cache) -> dict[str, Cache]:
    """The keyword argument a transformers forward takes its cache by: `cache` from 5.24 on (where
    `past_key_values` is deprecated, with a warning), `past_key_values` before."""
    return {_cache_keyword(type(module).forward): cache}


@functools.cache
def _cache_keyword(forward: Callable) -> str:
    takes_cache = "cache" in inspect.signature(forward).parameters
    return "cache" if takes_cache else "past_key_values"


class ForwardCache(Cache):
    """The transformers cache of one module forward over positions start..start+q of a sequence."""

    def __init__(self, kv: PagedKV, num_layers: int):
        super().__init__(layers=[_PagedLayer(self, i) for i in range(num_layers)])
        self.kv = kv
        self.start = 0

    def bind(self, start: int) -> None:
        self.start = start

    def update_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        return self.kv.store_whole(layer, keys, values)  # (1, Hk, start+q, D) each


class SelectiveCache(Cache):
    """The cache of a forward over some positions of a sequence of `length` positions, all held by
    the pool: new K/V overwrite those positions, attention reads all `length`.

    At the `measured` layers it first measures how far the new K/V lie from what the positions held."""

    def __init__(self, kv: PagedKV, num_layers: int, length: int, measured: set[int]):
        super().__init__(layers=[_PagedLayer(self, i) for i in range(num_layers)])
        self.kv, self.start, self.measured = kv, length, measured
        self.deviation: torch.Tensor | None = None  # (q,) at the last measured layer

    def update_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        # keys, values: (1, Hk, q, D) for the positions at the bound slots
        slots = self.kv.slots
        assert slots is not None
        if layer in self.measured:
            pool = self.kv.pool
            old_k = pool.keys[layer].index_select(1, slots).unsqueeze(0)  # (1, Hk, q, D)
            old_v = pool.values[layer].index_select(1, slots).unsqueeze(0)
            self.deviation = _relative_sq_error(keys, old_k) + _relative_sq_error(values, old_v)
        return self.kv.store_whole(layer, keys, values)  # (1, Hk, length, D) each


def _relative_sq_error(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Per position: squared distance, over the mean squared norm of `old`. (1, H, q, D) -> (q,)"""
    new, old = new.float(), old.float()
    error = (new - old).pow(2).sum(dim=(0, 1, 3))  # (q,)
    scale = old.pow(2).sum(dim=(0, 1, 3)).mean().clamp_min(1e-12)
    return error / scale
