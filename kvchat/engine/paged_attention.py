"""The paged KV pool and attention over it.

`KVPool` holds the K/V tensors of every block of every layer: the only owner of KV memory. A forward
(`PagedKV`; forward_cache.py hands it to a module forward as a transformers cache) writes its new K/V
into the sequence's blocks once, and each layer's attention reads the sequence's K/V from there,
inside the KV budget; sequences that take turns reload nothing.

The lean decode step's attention reads the pool in place, by slot, through kvchat's kernel
(native_attention.py) where it could be built. Otherwise, and for the module forward:

A sequence's blocks lie in a few runs of consecutive ids (a shared prefix, then its own blocks); a
run is a strided view of the pool. torch's CPU batched matmul reads such a view in place in fp32 but
copies it in bf16 (its heads are not packed back to back). So the decode step attends over the runs
in place (a split softmax: a matmul pair per run) where views are free and the context is long enough
for a copy to cost more than the extra matmuls; otherwise the runs are copied whole, at memcpy
speed, into the pool's read buffer (slot by slot past MAX_RUNS runs, about half as fast), which costs
a bf16 matmul no more than its own copy would. The module forward, which wants one tensor, gets a
view of one run or the copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvchat.native import kernels

MAX_RUNS = 16  # past this many runs, the slots are gathered one by one
VIEWS_FROM = 1024  # positions from which runs are read in place where the matmul reads views
VIEW_DTYPES = frozenset({torch.float32})  # torch 2.13 CPU bmm: an fp32 view is read in place, bf16 copied

KVRuns = list[tuple[torch.Tensor, torch.Tensor]]  # (keys, values) per run in position order, (Hk, T_run, D)


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


def slot_runs(block_table: list[int], block_size: int, length: int) -> list[tuple[int, int]]:
    """The pool slot ranges [start, stop) that hold positions 0..length-1 of a sequence, in order,
    consecutive blocks merged into one range."""
    runs: list[tuple[int, int]] = []
    for index, block_id in enumerate(block_table[: -(-length // block_size)]):
        start = block_id * block_size
        stop = start + min(block_size, length - index * block_size)
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], stop)
        else:
            runs.append((start, stop))
    return runs


def position_slots(block_table: list[int], block_size: int, length: int, device) -> torch.Tensor:
    """The pool slots of positions 0..length-1 of a sequence, one by one: (length,) long."""
    blocks = torch.tensor(block_table[: -(-length // block_size)], dtype=torch.long, device=device)
    offsets = torch.arange(block_size, dtype=torch.long, device=device)
    return (blocks[:, None] * block_size + offsets).view(-1)[:length]


class PagedKV:
    """The K/V of one forward over positions start..end-1 of a sequence whose earlier positions the
    pool holds: `store` writes a layer's new K/V and returns the layer's K/V over 0..end-1; `attend`
    writes them and attends over 0..end-1.

    With `kernel` (kvchat::paged_attention, native_attention.py), `attend` reads the pool in place by
    slot; without, it reads the runs as `store` returns them."""

    def __init__(self, pool: KVPool, kernel: Callable | None = None):
        self.pool, self.kernel = pool, kernel
        self.slots: torch.Tensor | None = None  # (q,) where the new K/V go
        self.runs: list[tuple[int, int]] = []  # where positions 0..end-1 are, as slot ranges
        self.all_slots: torch.Tensor | None = None  # the same one by one (T,), past MAX_RUNS runs
        self.block_table: list[int] = []
        self.length = 0
        self._slots_read: torch.Tensor | None = None  # (T,) as the kernel reads them, once per forward

    def bind(self, slots: torch.Tensor, block_table: list[int], length: int) -> None:
        """Prepare a forward writing its new K/V at pool `slots`, over a sequence of `length` positions
        held by the blocks of `block_table`."""
        bs = self.pool.block_size
        self.slots, self.length = slots, length
        self.runs = slot_runs(block_table, bs, length)
        self.block_table, self.all_slots, self._slots_read = block_table, None, None
        if len(self.runs) > MAX_RUNS:
            self.all_slots = position_slots(block_table, bs, length, slots.device)  # (T,)

    def attend(
        self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Keep one layer's new K/V (1, Hk, q, D), then the causal attention of the new queries
        (1, Hq, q, D) over all positions so far: (1, q, Hq * D)."""
        if self.kernel is None:
            return grouped_attention(query, self.store(layer, keys, values), scaling)
        self.write(layer, keys, values)
        _, num_heads, num_new, head_dim = query.shape
        # (Hk, G*q, D), row g*q + i: query head h reads KV head h // G, as transformers' repeat_kv does
        grouped = query.reshape(keys.shape[1], -1, head_dim)
        pool = self.pool
        out = self.kernel(grouped, pool.keys, pool.values, layer, self._positions(), num_new, scaling)
        out = out.to(query.dtype).view(num_heads, num_new, head_dim).transpose(0, 1)  # (q, Hq, D)
        return out.reshape(1, num_new, num_heads * head_dim)

    @property
    def in_place(self) -> bool:
        """Whether attention reads the pool in place (kvchat's kernels are built for it), so that
        `decoder_layers` serves."""
        return self.kernel is not None

    def decoder_layers(
        self,
        hidden: torch.Tensor,
        parts: list[torch.Tensor | None],
        eps: float,
        rotation: tuple[torch.Tensor, torch.Tensor],
        num_heads: int,
        scaling: float,
    ) -> torch.Tensor:
        """Every decoder layer in one op (kvchat::decoder_layers; decode_step.layer_parts gives `parts`
        and `eps`), each layer's new K/V written to the pool at `slots`: hidden (q, d) -> (q, d), the
        rotation cos and signed sin (q, D) as decode_step.rope takes them. Needs `in_place`."""
        pool, (cos, signed_sin) = self.pool, rotation
        op = kernels.decoder_layers()
        assert op is not None, "decoder_layers runs where the kernels are built (decode_step.LeanStep)"
        return op(
            hidden,
            parts,
            eps,
            cos,
            signed_sin,
            pool.keys,
            pool.values,
            self.slots,
            self._positions(),
            num_heads,
            scaling,
        )

    def store(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> KVRuns:
        """Keep one layer's new K/V (1, Hk, q, D); return all of its K/V so far as runs, valid until the
        next call."""
        self.write(layer, keys, values)
        views_are_read_in_place = self.pool.keys.dtype in VIEW_DTYPES
        in_place = len(self.runs) == 1 or (
            views_are_read_in_place and self.length >= VIEWS_FROM and len(self.runs) <= MAX_RUNS
        )
        if in_place:
            return [(self.pool.keys[layer, :, a:b], self.pool.values[layer, :, a:b]) for a, b in self.runs]
        return [self._copied(layer)]

    def store_whole(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """As `store`, as one tensor each, (1, Hk, length, D), the way attention modules take them."""
        self.write(layer, keys, values)
        if len(self.runs) == 1:
            a, b = self.runs[0]
            return self.pool.keys[layer, None, :, a:b], self.pool.values[layer, None, :, a:b]
        all_keys, all_values = self._copied(layer)
        return all_keys.unsqueeze(0), all_values.unsqueeze(0)

    def _positions(self) -> torch.Tensor:
        """The slots of positions 0..length-1 one by one (T,), made once per forward."""
        if self._slots_read is None:
            assert self.slots is not None
            self._slots_read = self.all_slots
            if self._slots_read is None:
                bs, device = self.pool.block_size, self.slots.device
                self._slots_read = position_slots(self.block_table, bs, self.length, device)
        return self._slots_read

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        assert self.slots is not None
        self.pool.write(layer, self.slots, keys, values)

    def _copied(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K/V over 0..length-1 in the read buffer: (Hk, T, D) each."""
        if self.all_slots is not None:
            return self.pool.read_slots(layer, self.all_slots)
        return self.pool.read_runs(layer, self.runs)


def grouped_attention(query: torch.Tensor, runs: KVRuns, scaling: float) -> torch.Tensor:
    """Causal attention of q new queries, at the last q of T positions, over the T keys and values
    given as runs in position order.

    On CPU, `scaled_dot_product_attention` in bf16 with one query is several times slower than two
    matmuls, more so as the context grows. Viewing the query
    heads per KV head lets one matmul serve a whole group without repeating K/V; the softmax runs in
    fp32. query (1, Hq, q, D) with Hq a multiple of Hk -> (1, q, Hq * D)."""
    _, num_heads, num_new, head_dim = query.shape
    num_kv_heads = runs[0][0].shape[0]
    group = num_heads // num_kv_heads
    # query head h reads KV head h // group, as transformers' repeat_kv lays them out
    grouped = query.reshape(num_kv_heads, group * num_new, head_dim).transpose(1, 2)  # (Hk, D, G*q)
    # keys times query rather than query times transposed keys: ~3x faster at 4,096 keys in bf16
    pieces = [torch.matmul(keys, grouped) for keys, _ in runs]  # (Hk, T_run, G*q) each
    scores = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)  # (Hk, T, G*q)
    scores = scores.transpose(1, 2).float() * scaling  # (Hk, G*q, T)
    length = scores.shape[-1]
    if num_new > 1:
        future = torch.ones(num_new, num_new, dtype=torch.bool, device=query.device).triu(1)  # (q, q)
        scores = scores.view(num_kv_heads, group, num_new, length)
        scores[..., length - num_new :].masked_fill_(future, float("-inf"))
    probs = scores.softmax(dim=-1).to(runs[0][1].dtype).view(num_kv_heads, group * num_new, length)
    out, start = None, 0
    for _, values in runs:
        stop = start + values.shape[1]
        part = probs[..., start:stop]  # (Hk, G*q, T_run)
        out = torch.matmul(part, values) if out is None else out.baddbmm_(part, values)  # (Hk, G*q, D)
        start = stop
    assert out is not None
    out = out.view(num_heads, num_new, head_dim).transpose(0, 1)  # (q, Hq, D)
    return out.reshape(1, num_new, num_heads * head_dim)
