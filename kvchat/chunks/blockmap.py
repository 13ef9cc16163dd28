"""A map of the KV pool for `/blocks`: every block's state, references, owning chunks and exactness.

Pure Python over the block manager's ints: owners come from the chunks' kept spans and from the live
sequence (the last inference, whose token list says which chunks it holds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvchat.chunks.chunk import Chunk
from kvchat.chunks.types import Role
from kvchat.engine.block_manager import BlockManager
from kvchat.engine.sequence import Sequence

if TYPE_CHECKING:
    from kvchat.chunks.context import ContextManager

PINNED, USED, CACHED, FREE = "pinned", "used", "cached", "free"


@dataclass(frozen=True)
class BlockCell:
    """One block that is not free."""

    block_id: int
    state: str  # "pinned", "used" (referenced) or "cached" (unreferenced, holding reusable KV)
    ref_count: int
    chunk_ids: list[str]  # chunks whose KV the block holds, in context order
    exact: bool  # False: some of its KV was moved (repositioned) or computed after moved KV


@dataclass(frozen=True)
class ChunkKey:
    """A chunk that owns blocks, as the legend shows it."""

    chunk_id: str
    number: int
    role: Role
    output_number: int | None
    num_blocks: int


@dataclass(frozen=True)
class BlockMap:
    num_blocks: int
    block_size: int
    blocks: list[BlockCell]  # every block not free, by id
    chunks: list[ChunkKey] = field(default_factory=list)

    @property
    def num_used(self) -> int:
        return sum(1 for b in self.blocks if b.state != CACHED)

    @property
    def num_pinned(self) -> int:
        return sum(1 for b in self.blocks if b.state == PINNED)

    @property
    def num_shared(self) -> int:
        return sum(1 for b in self.blocks if b.ref_count > 1)

    @property
    def num_cached(self) -> int:
        return sum(1 for b in self.blocks if b.state == CACHED)

    @property
    def num_moved(self) -> int:
        return sum(1 for b in self.blocks if not b.exact)

    @property
    def num_free(self) -> int:
        return self.num_blocks - len(self.blocks)

    def counts(self) -> dict[str, int]:
        return {
            "num_blocks": self.num_blocks,
            "num_used": self.num_used,
            "num_pinned": self.num_pinned,
            "num_shared": self.num_shared,
            "num_cached": self.num_cached,
            "num_moved": self.num_moved,
            "num_free": self.num_free,
        }


def block_map(
    blocks: BlockManager, chunks: list[Chunk], live: Sequence | None, live_chunks: list[Chunk]
) -> BlockMap:
    """The map of the pool. `chunks`: every registered chunk (their spans name blocks); `live_chunks`:
    the chunks the live sequence's tokens start with, in order."""
    owners: dict[int, list[str]] = {}
    moved: set[int] = set()
    if live is not None and live.block_table:
        start = 0
        for chunk in live_chunks:
            for block_id in live.blocks_covering(start, start + len(chunk.token_ids)):
                owners.setdefault(block_id, []).append(chunk.chunk_id)
            start += len(chunk.token_ids)
        moved.update(live.blocks_covering(live.exact_limit, live.num_computed))
    for chunk in chunks:
        span = chunk.span
        if span is None or not span.is_valid(blocks):
            continue
        for block_id in span.block_ids:
            if chunk.chunk_id not in owners.setdefault(block_id, []):
                owners[block_id].append(chunk.chunk_id)
            if not span.exact:
                moved.add(block_id)
    cells = [_cell(blocks, b, owners.get(b, []), b not in moved) for b in range(blocks.num_blocks)]
    kept = [c for c in cells if c is not None]
    by_id = {c.chunk_id: c for c in chunks}
    count: dict[str, int] = {}
    for cell in kept:
        for chunk_id in cell.chunk_ids:
            count[chunk_id] = count.get(chunk_id, 0) + 1
    keys = [
        ChunkKey(i, by_id[i].number, by_id[i].role, by_id[i].output_number, n)
        for i, n in sorted(count.items(), key=lambda item: by_id[item[0]].number)
    ]
    return BlockMap(blocks.num_blocks, blocks.block_size, kept, keys)


def _cell(blocks: BlockManager, block_id: int, chunk_ids: list[str], exact: bool) -> BlockCell | None:
    block = blocks.blocks[block_id]
    if block.ref_count == 0:
        if block.parent_hash is None:
            return None  # free: nothing reusable in it
        # An unreferenced block holds only recorded (exact) KV; a stale owner entry cannot apply.
        return BlockCell(block_id, CACHED, 0, chunk_ids, True)
    state = PINNED if block.pin_count > 0 else USED
    return BlockCell(block_id, state, block.ref_count, chunk_ids, exact)


def live_chunks(cm: ContextManager) -> list[Chunk]:
    """The chunks the live sequence's tokens are made of, in order, as far as registered chunks
    account for them (the token list is the truth; the longest chunk matching at each place wins)."""
    live = cm.live
    if live is None:
        return []
    candidates = [c for c in cm.registry.chunks.values() if c.token_ids]
    found: list[Chunk] = []
    pos = 0
    while True:
        matches = [c for c in candidates if live.token_ids[pos : pos + len(c.token_ids)] == c.token_ids]
        if not matches:
            return found
        chunk = max(matches, key=lambda c: (len(c.token_ids), c.number))  # ties: the newest
        found.append(chunk)
        pos += len(chunk.token_ids)


def cache_map(cm: ContextManager) -> BlockMap:
    """The map of the manager's pool, its chunks and its live sequence."""
    chunks = list(cm.registry.chunks.values())
    return block_map(cm.engine.blocks, chunks, cm.live, live_chunks(cm))
