"""A context placed by the chat template: its chunks in the order the template writes them, each with the
ids it has there, and the generation prompt after them. The ids joined are what `apply_chat_template`
gives for the context's messages. Pure Python over ints.

A chunk's own `token_ids` are the ids its kept KV was computed for; where it is placed now may give it
other ids (a passage first in a user turn has the turn's header before it, a later one the separator; a
template may move the system prompt). Composition compares the two: what they share can be reused.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvchat.chunks.chunk import Chunk
from kvchat.chunks.rendering import Rendering


@dataclass(frozen=True)
class Placement:
    chunks: list[Chunk]  # in the order of their ids in the context
    piece_ids: list[list[int]]  # each chunk's ids here
    tail_ids: list[int]  # the generation prompt
    sources: list[Chunk]  # the same chunks in the conversation's order (system, context, turns, query)

    @property
    def token_ids(self) -> list[int]:
        return [t for ids in self.piece_ids for t in ids] + self.tail_ids

    @property
    def ranges(self) -> list[tuple[Chunk, int, int]]:
        """Each chunk and its positions [start, end)."""
        ranges, pos = [], 0
        for chunk, ids in zip(self.chunks, self.piece_ids, strict=True):
            ranges.append((chunk, pos, pos + len(ids)))
            pos += len(ids)
        return ranges


def place(rendering: Rendering, chunks: list[Chunk], lead: Chunk | None) -> Placement:
    """The placement of `chunks` (part i of the rendering is chunks[i]), with `lead` standing for what
    the template writes before the first message (left out when it wrote nothing there)."""
    pieces = [list(rendering.part_ids(i)) for i in rendering.order]
    ordered, sources = [chunks[i] for i in rendering.order], list(chunks)
    lead_ids = rendering.lead_ids
    if lead is not None and lead_ids:
        ordered, pieces, sources = [lead, *ordered], [lead_ids, *pieces], [lead, *sources]
    elif lead_ids:  # no chunk stands for it: the first chunk's piece holds it
        pieces[0] = lead_ids + pieces[0]
    return Placement(ordered, pieces, rendering.tail_ids, sources)


def shared_runs(own_ids: list[int], placed_ids: list[int]) -> list[tuple[int, int, int]]:
    """Where a chunk's own ids (its kept KV) and its ids as placed agree: (own offset, placed offset,
    length) of their common head and their common tail, the runs whose KV can be moved."""
    limit = min(len(own_ids), len(placed_ids))
    head = 0
    while head < limit and own_ids[head] == placed_ids[head]:
        head += 1
    tail = 0
    while tail < limit - head and own_ids[-1 - tail] == placed_ids[-1 - tail]:
        tail += 1
    runs = [(0, 0, head)] if head else []
    if tail:
        runs.append((len(own_ids) - tail, len(placed_ids) - tail, tail))
    return runs
