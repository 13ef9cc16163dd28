"""Building a sequence for a context of chunks, reusing KV as the reuse mode allows.

exact: share the longest cached exact prefix, compute the rest (equals a full recompute).
reposition: beyond that prefix, a chunk whose KV is kept elsewhere is copied with its keys rotated to
  its new positions; it never attended to the chunks now before it, so the result is approximate.
repair: as reposition, but the first tokens of each such chunk are recomputed in place, which
  restores part of the attention across chunks.
The last chunks are left uncomputed: the token loop's prefill computes them and yields the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvchat.chunks.registry import Chunk
from kvchat.chunks.types import ChunkReport, ReuseMode
from kvchat.engine.engine import Engine
from kvchat.engine.rope import rerotate_keys_
from kvchat.engine.sequence import Sequence


@dataclass(frozen=True)
class RepairPolicy:
    share: float = 0.15
    min_tokens: int = 4

    def num_recomputed(self, num_tokens: int) -> int:
        return min(num_tokens, max(self.min_tokens, math.ceil(self.share * num_tokens)))


@dataclass
class ComposedSequence:
    seq: Sequence
    chunk_ranges: list[tuple[Chunk, int, int]]  # each chunk and its positions [start, end)
    num_prompt: int  # the chunks' tokens and the generation prompt after them
    num_reused: int  # leading positions whose exact KV was shared or copied
    repositioned: list[tuple[int, int]]  # position ranges filled with moved KV

    @property
    def num_repositioned(self) -> int:
        return sum(end - start for start, end in self.repositioned)

    def reports(self) -> list[ChunkReport]:
        """Per chunk, then the generation prompt: what was reused, moved and computed so far."""
        computed_until = min(self.seq.num_computed, self.num_prompt)
        end_of_chunks = self.chunk_ranges[-1][2] if self.chunk_ranges else 0
        rows = [(c.chunk_id, c.role, a, b) for c, a, b in self.chunk_ranges]
        out = []
        for chunk_id, role, start, end in [*rows, (None, None, end_of_chunks, self.num_prompt)]:
            reused = max(0, min(end, self.num_reused) - start)
            moved = sum(max(0, min(end, b) - max(start, a)) for a, b in self.repositioned)
            done = max(0, min(end, computed_until) - start)
            out.append(ChunkReport(chunk_id, role, end - start, reused, moved, done - reused - moved))
        return out


def chunk_ranges(chunks: list[Chunk]) -> list[tuple[Chunk, int, int]]:
    ranges, pos = [], 0
    for chunk in chunks:
        ranges.append((chunk, pos, pos + len(chunk.token_ids)))
        pos += len(chunk.token_ids)
    return ranges


def compose(
    engine: Engine,
    chunks: list[Chunk],
    tail_ids: list[int],
    mode: ReuseMode,
    repair: RepairPolicy,
    inv_freq=None,
) -> ComposedSequence:
    """A sequence over the chunks' tokens + `tail_ids`, with as much KV filled in as `mode` allows."""
    ranges = chunk_ranges(chunks)
    token_ids = [t for chunk in chunks for t in chunk.token_ids] + list(tail_ids)
    movable = []
    if mode is not ReuseMode.EXACT:
        movable = [
            (chunk, start, end)
            for chunk, start, end in ranges
            if chunk.span is not None and chunk.span.is_valid(engine.blocks) and end - start > 0
        ]
    held = sorted({b for chunk, _, _ in movable for b in chunk.span.block_ids})  # type: ignore[union-attr]
    with engine.blocks.hold(held):  # keep the sources from being evicted by the allocation
        seq = engine.start(token_ids)
        with engine.owning(seq):
            composed = ComposedSequence(seq, ranges, len(token_ids), seq.num_computed, [])
            for chunk, start, end in movable:
                if end <= seq.num_computed or end >= len(token_ids):
                    continue  # already there, or the very last tokens (they must produce logits)
                _place(engine, seq, chunk, start, end, mode, repair, inv_freq, composed)
    return composed


def _place(engine, seq, chunk, start, end, mode, repair, inv_freq, composed: ComposedSequence) -> None:
    span = chunk.span
    if seq.num_computed < start:
        engine.compute(seq, until=start)
    # A chunk may start inside the exact prefix (its first tokens matched): move only the rest.
    first_moved = max(
        seq.num_computed, start + (repair.num_recomputed(end - start) if mode is ReuseMode.REPAIR else 0)
    )
    if first_moved > seq.num_computed:
        engine.compute(seq, until=first_moved)
    if first_moved == end:
        return
    slots = span.slots(engine.block_size)[first_moved - start :]
    keys, values = engine.gather(slots)  # (L, T, H, D)
    keys = rerotate_keys_(keys, start - span.start_pos, inv_freq)
    engine.write_kv(seq, first_moved, keys, values)
    composed.repositioned.append((first_moved, end))
