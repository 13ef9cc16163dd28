"""Building a sequence for a context of chunks, reusing KV as the reuse mode allows.

exact: share the longest cached exact prefix, compute the rest (equals a full recompute).
reposition: beyond that prefix, a chunk whose KV is kept elsewhere is copied with its keys rotated to
  its new positions; it never attended to the chunks now before it, so the result is approximate.
repair: as reposition, then part of the moved tokens are recomputed in place, which restores part of
  the attention across chunks: each moved chunk's first tokens (strategy prefix), or the moved tokens
  whose KV deviates most from a forward in the new context (strategy deviation, kvchat.engine.blend).
The last chunks are left uncomputed: the token loop's prefill computes them and yields the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvchat.chunks.chunk import Chunk
from kvchat.chunks.placement import shared_runs
from kvchat.chunks.types import ChunkReport, RepairStrategy, ReuseMode
from kvchat.engine.blend import recompute_selected
from kvchat.engine.block_manager import Sequence
from kvchat.engine.engine import Engine
from kvchat.engine.rope import KeyRotation


@dataclass(frozen=True)
class RepairPolicy:
    """What repair recomputes; built from the reuse settings (kvchat.session.repair_policy)."""

    share: float
    min_tokens: int
    strategy: RepairStrategy
    # deviation: 0 selects once; t > 0 narrows the selection after every layer, from share ** (1 - t)
    # of the moved tokens into the first layer after the probe down to share ** (1 + t) into the last
    taper: float
    probe_layer: int = 1  # deviation: layers 0..probe_layer run over every moved token

    def __post_init__(self) -> None:
        if not (0 <= self.share <= 1 and 0 <= self.taper < 1 and self.probe_layer >= 0):
            raise ValueError(f"not a repair policy: {self}")

    def num_recomputed(self, num_tokens: int) -> int:
        return min(num_tokens, max(self.min_tokens, math.ceil(self.share * num_tokens)))

    def layer_shares(self, num_layers: int) -> list[float]:
        """Deviation: the share of the moved tokens run through each layer after the probe layer."""
        count = num_layers - 1 - self.probe_layer
        steps = [j / (count - 1) if count > 1 else 0.5 for j in range(count)]
        return [self.share ** (1 - self.taper + 2 * self.taper * step) for step in steps]


# A manager given no policy repairs nothing: repair mode then equals reposition.
NO_REPAIR = RepairPolicy(0.0, 0, RepairStrategy.PREFIX, 0.0)


@dataclass
class ComposedSequence:
    seq: Sequence
    chunk_ranges: list[tuple[Chunk, int, int]]  # each chunk and its positions [start, end)
    num_prompt: int  # the chunks' tokens and the generation prompt after them
    num_reused: int  # leading positions whose exact KV was shared or copied
    repositioned: list[tuple[int, int]]  # position ranges filled with moved KV
    recomputed: list[int] = field(default_factory=list)  # positions of moved chunks repair computed
    # deviation: moved tokens run through each layer after the probe layer
    recompute_layers: list[int] = field(default_factory=list)

    @property
    def num_repositioned(self) -> int:
        """Positions whose moved KV is kept (recomputed ones count as computed)."""
        return self._num_moved(0, len(self.seq.token_ids))

    def _num_moved(self, start: int, end: int) -> int:
        moved = sum(max(0, min(end, b) - max(start, a)) for a, b in self.repositioned)
        replaced = sum(
            1 for p in self.recomputed if start <= p < end and any(a <= p < b for a, b in self.repositioned)
        )
        return moved - replaced

    def reports(self) -> list[ChunkReport]:
        """Per chunk, then the generation prompt: what was reused, moved and computed so far."""
        computed_until = min(self.seq.num_computed, self.num_prompt)
        end_of_chunks = self.chunk_ranges[-1][2] if self.chunk_ranges else 0
        rows = [(c.chunk_id, c.role, a, b) for c, a, b in self.chunk_ranges]
        out = []
        for chunk_id, role, start, end in [*rows, (None, None, end_of_chunks, self.num_prompt)]:
            reused = max(0, min(end, self.num_reused) - start)
            moved = self._num_moved(start, end)
            recomputed = sum(1 for p in self.recomputed if start <= p < end)
            done = max(0, min(end, computed_until) - start)
            out.append(
                ChunkReport(chunk_id, role, end - start, reused, moved, done - reused - moved, recomputed)
            )
        return out


def chunk_ranges(chunks: list[Chunk]) -> list[tuple[Chunk, int, int]]:
    """Each chunk and its positions [start, end) when the chunks' own ids are joined."""
    ranges, pos = [], 0
    for chunk in chunks:
        ranges.append((chunk, pos, pos + len(chunk.token_ids)))
        pos += len(chunk.token_ids)
    return ranges


def compose(
    engine: Engine,
    seq: Sequence,
    ranges: list[tuple[Chunk, int, int]],
    mode: ReuseMode,
    repair: RepairPolicy,
    rotation: KeyRotation | None = None,
) -> ComposedSequence:
    """Give a new sequence over the chunks' tokens (each chunk at its range, then a tail, the generation
    prompt) its blocks, with as much KV filled in as `mode` allows. Where a chunk's ids here differ from
    the ids its KV was kept for, only what they share is moved (placement.shared_runs). The caller owns
    `seq`, and so every block it takes."""
    num_tokens = seq.num_tokens
    movable = []
    if mode is not ReuseMode.EXACT:
        assert rotation is not None, "moving KV needs the model's key rotation"
        movable = [
            (chunk, start, end)
            for chunk, start, end in ranges
            if chunk.span is not None and chunk.span.is_valid(engine.blocks) and end - start > 0
        ]
    held = sorted({b for chunk, _, _ in movable for b in chunk.span.block_ids})  # type: ignore[union-attr]
    by_prefix = mode is ReuseMode.REPAIR and repair.strategy == RepairStrategy.PREFIX
    with engine.blocks.hold(held):  # keep the sources from being evicted by the allocation
        engine.admit(seq)
        composed = ComposedSequence(seq, list(ranges), num_tokens, seq.num_computed, [])
        for chunk, start, end in movable:
            if end <= seq.num_computed or end >= num_tokens:
                continue  # already there, or the very last tokens (they must produce logits)
            _place(engine, seq, chunk, start, end, repair if by_prefix else None, rotation, composed)
        if mode is ReuseMode.REPAIR and not by_prefix and composed.repositioned:
            _recompute_deviating(engine, composed, repair)
    return composed


def _place(engine, seq, chunk, start, end, repair, rotation, composed: ComposedSequence) -> None:
    """Move the chunk's KV to start..end where its ids there match its own (the tokens between are
    computed); with a prefix `repair` policy, compute its first tokens instead."""
    span = chunk.span
    if seq.num_computed < start:
        engine.compute(seq, until=start)
    first = max(seq.num_computed, start + (repair.num_recomputed(end - start) if repair else 0))
    if first > seq.num_computed:
        composed.recomputed += range(seq.num_computed, first)
        engine.compute(seq, until=first)
    for own, placed, length in shared_runs(chunk.token_ids, seq.token_ids[start:end]):
        # A run may begin inside what is computed already (its first tokens matched): move the rest.
        a, b = max(start + placed, seq.num_computed), start + placed + length
        if a >= b:
            continue
        if seq.num_computed < a:
            engine.compute(seq, until=a)
        source = own + a - start - placed  # the run's first moved token in the chunk's own ids
        keys, values = engine.gather(span.slots(engine.block_size)[source : source + b - a])  # (L, T, H, D)
        keys = rotation.rotate_(keys, a - span.start_pos - source)
        engine.write_kv(seq, a, keys, values)
        composed.repositioned.append((a, b))


def _recompute_deviating(engine: Engine, composed: ComposedSequence, repair: RepairPolicy) -> None:
    """Recompute `share` of the moved tokens: each moved chunk's first `min_tokens`, then those whose
    KV deviates most. The tokens computed among the moved chunks are recomputed too."""
    seq = composed.seq
    start = composed.repositioned[0][0]
    moved = [False] * (seq.num_computed - start)
    forced = [True] * (seq.num_computed - start)
    for a, b in composed.repositioned:
        moved[a - start : b - start] = [True] * (b - a)
        head = min(b, a + repair.min_tokens)
        forced[head - start : b - start] = [False] * (b - head)
    num_moved, heads = sum(moved), sum(f and m for f, m in zip(forced, moved, strict=True))
    if math.ceil(repair.share * num_moved) == 0:
        return
    repair = replace(repair, probe_layer=min(repair.probe_layer, engine.num_layers - 1))
    schedule = [max(0, math.ceil(s * num_moved) - heads) for s in repair.layer_shares(engine.num_layers)]
    ran = recompute_selected(engine, seq, start, forced, schedule, repair.probe_layer)
    # Without layers after the probe layer, every position ran through every layer.
    first = ran[0] if ran else range(start, seq.num_computed)
    composed.recomputed += [p for p in first if moved[p - start]]
    composed.recompute_layers = [sum(moved[p - start] for p in layer) for layer in ran]
