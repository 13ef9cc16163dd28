"""The KV tensors: one pool of fixed-size blocks for every layer. The only owner of KV memory."""

from __future__ import annotations

import torch


class KVPool:
    """Keys and values of every block, head-major, slot = block_id * block_size + offset: a run of
    consecutive slots of one layer is a (H, T, D) view with each head's positions contiguous, as
    attention's matmuls read them."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.block_size = block_size
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (L, H, S, D)
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # (L, H, S, D)
        # Room for one layer's K/V of every slot, where attention reads a sequence's K/V gathered
        self._read_buffer = torch.empty((2, *shape[1:]), dtype=dtype, device=device)  # (2, H, S, D)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """A block's share of the pool: its K/V in every layer, and in the read buffer (one layer more)."""
        return 2 * (num_layers + 1) * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one layer's new K/V, given as (1, H, q, D) the way attention produces them."""
        self.keys[layer].index_copy_(1, slots, keys[0])  # (H, q, D) into (H, S, D)
        self.values[layer].index_copy_(1, slots, values[0])

    def read_runs(self, layer: int, runs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K/V over these slot ranges, in order, copied into the read buffer (valid until
        the next read): (H, T, D) each, contiguous."""
        keys, values = self._read_space(sum(b - a for a, b in runs))
        at = 0
        for a, b in runs:
            keys[:, at : at + b - a] = self.keys[layer, :, a:b]
            values[:, at : at + b - a] = self.values[layer, :, a:b]
            at += b - a
        return keys, values

    def read_slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As `read_runs`, for slots given one by one (T,)."""
        keys, values = self._read_space(len(slots))
        torch.index_select(self.keys[layer], 1, slots, out=keys)
        torch.index_select(self.values[layer], 1, slots, out=values)
        return keys, values

    def _read_space(self, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        num_heads, _, head_dim = self.keys.shape[1:]
        size = num_heads * num_slots * head_dim
        keys, values = (
            buffer.view(-1)[:size].view(num_heads, num_slots, head_dim) for buffer in self._read_buffer
        )
        return keys, values

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of every layer at these slots: (L, T, H, D) each."""
        keys, values = self.keys.index_select(2, slots), self.values.index_select(2, slots)  # (L, H, T, D)
        return keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()

    def scatter(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store K/V of every layer, given as (L, T, H, D)."""
        self.keys.index_copy_(2, slots, keys.to(self.keys.dtype).transpose(1, 2))
        self.values.index_copy_(2, slots, values.to(self.values.dtype).transpose(1, 2))

    def copy(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        self.keys.index_copy_(2, dst_slots, self.keys.index_select(2, src_slots))
        self.values.index_copy_(2, dst_slots, self.values.index_select(2, src_slots))
