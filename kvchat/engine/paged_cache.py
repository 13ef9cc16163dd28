"""The transformers `Cache` that a forward pass writes through: new K/V go into the block pool and into
a contiguous workspace of the sequence being run, and attention reads the workspace.

Gathering every block of the context at every decode step would copy the whole KV per token; the
workspace is filled from the pool once when a sequence (re)starts and then only appended to.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvchat.engine.kv_pool import KVPool


class KVWorkspace:
    """Contiguous K/V of one sequence: (1, H, capacity, D) per layer, valid up to `length`."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = 0
        self.owner: tuple[int, int] | None = None  # (id of the sequence, its kv_version)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def reserve(self, num_tokens: int) -> None:
        if self.keys and num_tokens <= self.capacity:
            return
        capacity = max(num_tokens, 2 * self.capacity, 256)
        shape = (1, self.num_kv_heads, capacity, self.head_dim)
        keys = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        values = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for layer in range(len(self.keys)):
            keys[layer][:, :, : self.length] = self.keys[layer][:, :, : self.length]
            values[layer][:, :, : self.length] = self.values[layer][:, :, : self.length]
        self.keys, self.values = keys, values

    def load(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the contents with K/V given as (L, T, H, D)."""
        num_tokens = keys.shape[1]
        self.length = 0
        self.reserve(num_tokens)
        for layer in range(self.num_layers):
            self.keys[layer][0, :, :num_tokens] = keys[layer].transpose(0, 1)  # (H, T, D)
            self.values[layer][0, :, :num_tokens] = values[layer].transpose(0, 1)
        self.length = num_tokens

    def clear(self) -> None:
        self.length, self.owner = 0, None


class _PagedLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, cache: ForwardCache | SelectiveCache, layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.cache.store(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.start + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.start

    def get_max_length(self) -> int:
        return -1


class ForwardCache(Cache):
    """The cache object of one forward pass over positions start..start+q of the workspace's sequence."""

    def __init__(self, workspace: KVWorkspace, pool: KVPool):
        super().__init__(layers=[_PagedLayer(self, i) for i in range(workspace.num_layers)])
        self.workspace, self.pool = workspace, pool
        self.start = 0
        self.slots: torch.Tensor | None = None

    def bind(self, start: int, num_new: int, slots: torch.Tensor) -> None:
        """Prepare for a forward of `num_new` tokens at `start`, writing to pool `slots`."""
        assert self.workspace.length == start, (self.workspace.length, start)
        self.workspace.reserve(start + num_new)
        self.start, self.slots = start, slots

    def store(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        # keys, values: (1, H, q, D)
        end = self.start + keys.shape[2]
        ws_k, ws_v = self.workspace.keys[layer], self.workspace.values[layer]
        ws_k[:, :, self.start : end] = keys
        ws_v[:, :, self.start : end] = values
        assert self.slots is not None
        self.pool.write(layer, self.slots, keys, values)
        if layer == self.workspace.num_layers - 1:
            self.workspace.length = end
        return ws_k[:, :, :end], ws_v[:, :, :end]  # (1, H, start+q, D)


class SelectiveCache(Cache):
    """The cache of a forward over some positions of a sequence whose K/V up to `length` sit in the
    workspace: new K/V overwrite those positions (workspace and pool), attention reads all `length`.

    At the `measured` layers it first measures how far the new K/V lie from what the positions held."""

    def __init__(self, workspace: KVWorkspace, pool: KVPool, length: int, measured: set[int]):
        super().__init__(layers=[_PagedLayer(self, i) for i in range(workspace.num_layers)])
        self.workspace, self.pool, self.start = workspace, pool, length
        self.measured = measured
        self.positions: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None
        self.deviation: torch.Tensor | None = None  # (q,) at the last measured layer

    def bind(self, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.positions, self.slots = positions, slots

    def store(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        # keys, values: (1, H, q, D) for the bound positions
        assert self.positions is not None and self.slots is not None
        ws_k, ws_v = self.workspace.keys[layer], self.workspace.values[layer]
        if layer in self.measured:
            self.deviation = _relative_sq_error(keys, ws_k[:, :, self.positions]) + _relative_sq_error(
                values, ws_v[:, :, self.positions]
            )
        ws_k.index_copy_(2, self.positions, keys)
        ws_v.index_copy_(2, self.positions, values)
        self.pool.write(layer, self.slots, keys, values)
        return ws_k[:, :, : self.start], ws_v[:, :, : self.start]  # (1, H, length, D)


def _relative_sq_error(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Per position: squared distance, over the mean squared norm of `old`. (1, H, q, D) -> (q,)"""
    new, old = new.float(), old.float()
    error = (new - old).pow(2).sum(dim=(0, 1, 3))  # (q,)
    scale = old.pow(2).sum(dim=(0, 1, 3)).mean().clamp_min(1e-12)
    return error / scale
