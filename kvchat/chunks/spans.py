"""Where a chunk's KV is kept: a run of positions in blocks of the pool, computed at known positions.

A pinned span holds a reference on its blocks. An unpinned one holds none: it stays usable while its
blocks were not handed out again (their generation is unchanged), and is evicted with them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvchat.engine.block_manager import BlockManager
from kvchat.engine.sequence import Sequence


@dataclass(frozen=True)
class KVSpan:
    block_ids: tuple[int, ...]
    generations: tuple[int, ...]
    offset: int  # slot offset of the first token in block_ids[0]
    num_tokens: int
    start_pos: int  # position the KV was computed at
    exact: bool  # computed over an exactly computed prefix
    pinned: bool

    @classmethod
    def of(
        cls, blocks: BlockManager, seq: Sequence, start: int, end: int, exact: bool, pinned: bool
    ) -> KVSpan:
        block_ids = tuple(seq.blocks_covering(start, end))
        span = cls(
            block_ids,
            tuple(blocks.blocks[b].generation for b in block_ids),
            start % seq.block_size,
            end - start,
            start,
            exact,
            pinned,
        )
        if pinned:
            blocks.pin(list(block_ids))
        return span

    def is_valid(self, blocks: BlockManager) -> bool:
        return all(
            blocks.blocks[b].generation == g for b, g in zip(self.block_ids, self.generations, strict=True)
        )

    def slots(self, block_size: int) -> list[int]:
        return [
            self.block_ids[(self.offset + i) // block_size] * block_size + (self.offset + i) % block_size
            for i in range(self.num_tokens)
        ]

    def release(self, blocks: BlockManager) -> None:
        if self.pinned:
            blocks.unpin(list(self.block_ids))
