"""A map of the KV pool for `/blocks`: every block's state, references, owning chunks and exactness.

Pure Python over a ViewState's ints: owners come from the chunks' kept spans and from the live
sequence (the last inference, whose token list says which chunks it holds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvchat.chunks.chunk import Chunk
from kvchat.chunks.types import Role
from kvchat.chunks.view_state import BlockState, ViewState

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


def block_map(state: ViewState) -> BlockMap:
    """The map of the pool: owners from the chunks' kept spans and the chunks the live sequence holds."""
    owners: dict[int, list[str]] = {}
    moved: set[int] = set()
    live = state.live
    if live is not None and live.block_table:
        start = 0
        for chunk in live_chunks(state):
            for block_id in live.blocks_covering(start, start + len(chunk.token_ids)):
                owners.setdefault(block_id, []).append(chunk.chunk_id)
            start += len(chunk.token_ids)
        moved.update(live.blocks_covering(live.exact_limit, live.num_computed))
    for chunk_id, span in state.kept_spans.items():
        for block_id in span.block_ids:
            if chunk_id not in owners.setdefault(block_id, []):
                owners[block_id].append(chunk_id)
            if not span.exact:
                moved.add(block_id)
    cells = [_cell(b, block, owners.get(b, []), b not in moved) for b, block in enumerate(state.blocks)]
    kept = [c for c in cells if c is not None]
    by_id = {c.chunk_id: c for c in state.chunks}
    count: dict[str, int] = {}
    for cell in kept:
        for chunk_id in cell.chunk_ids:
            count[chunk_id] = count.get(chunk_id, 0) + 1
    keys = [
        ChunkKey(i, by_id[i].number, by_id[i].role, by_id[i].output_number, n)
        for i, n in sorted(count.items(), key=lambda item: by_id[item[0]].number)
    ]
    return BlockMap(len(state.blocks), state.block_size, kept, keys)


def _cell(block_id: int, block: BlockState, chunk_ids: list[str], exact: bool) -> BlockCell | None:
    if block.ref_count == 0:
        if not block.holds_kv:
            return None  # free: nothing reusable in it
        # An unreferenced block holds only recorded (exact) KV; a stale owner entry cannot apply.
        return BlockCell(block_id, CACHED, 0, chunk_ids, True)
    state = PINNED if block.pin_count > 0 else USED
    return BlockCell(block_id, state, block.ref_count, chunk_ids, exact)


def live_chunks(state: ViewState) -> list[Chunk]:
    """The chunks the live sequence's tokens are made of, in order, as far as registered chunks
    account for them (the token list is the truth; the longest chunk matching at each place wins)."""
    live = state.live
    if live is None:
        return []
    candidates = [c for c in state.chunks if c.token_ids]
    found: list[Chunk] = []
    pos = 0
    while True:
        matches = [c for c in candidates if live.token_ids[pos : pos + len(c.token_ids)] == c.token_ids]
        if not matches:
            return _as_the_answer_read_them(state, found)
        chunk = max(matches, key=lambda c: (len(c.token_ids), c.number))  # ties: the newest
        found.append(chunk)
        pos += len(chunk.token_ids)


def _as_the_answer_read_them(state: ViewState, found: list[Chunk]) -> list[Chunk]:
    """Two outputs of the same text match the same tokens, so a place can name the wrong one; when the
    sequence ends in an answer, the chunks it was generated from say which ones it read."""
    if not found or found[-1].role is not Role.OUTPUT or not found[-1].source_ids:
        return found
    sources = [state.chunk(chunk_id) for chunk_id in found[-1].source_ids]
    read = [c for c in sources if c is not None]
    same_tokens = [t for c in read for t in c.token_ids] == [t for c in found[:-1] for t in c.token_ids]
    return [*read, found[-1]] if len(read) == len(sources) and same_tokens else found


def cache_map(cm: ContextManager) -> BlockMap:
    """The map of the manager's pool, its chunks and its live sequence."""
    return block_map(cm.view_state())
