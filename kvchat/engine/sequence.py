"""A sequence: its token ids and the blocks that hold their KV. Everything else is derived."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sequence:
    token_ids: list[int]
    block_size: int
    seq_id: int = 0
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose KV is written
    num_exact: int | None = None  # leading tokens whose KV is exact; None: all of them
    num_recorded: int = 0  # leading tokens already declared reusable to the block manager
    block_hashes: list[int] = field(default_factory=list)  # chain hash after each full block, memoized
    indexed: bool = True  # whether its exact KV is declared reusable to the block manager

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks_needed(self) -> int:
        return -(-self.num_tokens // self.block_size)

    @property
    def exact_limit(self) -> int:
        return self.num_tokens if self.num_exact is None else self.num_exact

    def slot(self, position: int) -> int:
        return self.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, start: int, end: int) -> list[int]:
        return self.slots_at(range(start, end))

    def slots_at(self, positions) -> list[int]:
        return [self.slot(i) for i in positions]

    def blocks_covering(self, start: int, end: int) -> list[int]:
        """The block ids that hold positions start..end-1."""
        if end <= start:
            return []
        return self.block_table[start // self.block_size : (end - 1) // self.block_size + 1]
