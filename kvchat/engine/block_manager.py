"""Bookkeeping of the paged KV cache: which block holds which tokens, who references it, what can go.

Pure Python over ints; the tensors live in the KV pool (`paged_attention`). A `Sequence` is a run of
token ids and its block table. A block's KV is valid for the tokens it records together with the
exact prefix its hash chain names, so a lookup can trust it. Blocks holding approximate KV
(repositioned chunks) are never recorded, so they can never be served as exact.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvchat.errors import CacheFullError

ROOT_HASH = 0


def chain_hash(parent_hash: int, token_ids: list[int]) -> int:
    """Hash of a block's tokens together with the hash of everything before them."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return int.from_bytes(h.digest(), "little")


@dataclass
class Sequence:
    """A sequence: its token ids and the blocks that hold their KV. Everything else is derived."""

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


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    pin_count: int = 0
    parent_hash: int | None = None  # None: holds no reusable KV
    token_ids: list[int] = field(default_factory=list)  # tokens whose exact KV is in this block
    hash: int | None = None  # chained hash, for a full block with reusable KV
    generation: int = 0  # bumped each time the block is handed out anew, invalidating old handles


@dataclass(frozen=True)
class PrefixMatch:
    """Blocks that already hold the KV of a prompt's first tokens."""

    shared_block_ids: list[int]  # full blocks to share as they are
    copy_from: int | None  # a block whose first `num_copy` tokens' KV are to be copied
    num_copy: int

    def num_tokens(self, block_size: int) -> int:
        return len(self.shared_block_ids) * block_size + self.num_copy


class BlockManager:
    """Free list, reference counts, pins, and the index of blocks that hold reusable KV."""

    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks, least recently released first; those with KV stay findable until reused.
        self._unreferenced: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[int, int] = {}
        self._children: dict[int, set[int]] = {}
        self.hit_tokens = 0
        self.lookup_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def capacity_tokens(self) -> int:
        """The most tokens the blocks can hold, all of them together."""
        return self.num_blocks * self.block_size

    def generation(self, block_id: int) -> int:
        """How many times the block was handed out: a handle taken at another generation is stale."""
        return self.blocks[block_id].generation

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def states(self) -> list[tuple[int, int, bool]]:
        """(references, pins, holds reusable KV) of each block, in block order."""
        return [(b.ref_count, b.pin_count, b.parent_hash is not None) for b in self.blocks]

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (unreferenced, with or without reusable KV)."""
        return len(self._unreferenced)

    @property
    def num_cached(self) -> int:
        return sum(1 for i in self._unreferenced if self.blocks[i].parent_hash is not None)

    @property
    def num_pinned(self) -> int:
        return sum(1 for b in self.blocks if b.pin_count > 0)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def reset_stats(self) -> None:
        """Start the hit-rate counts afresh (a session reset); the cached KV itself is untouched."""
        self.hit_tokens = self.lookup_tokens = 0

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> list[int]:
        """Fresh blocks, evicting the least recently released cached ones first."""
        if not self.can_allocate(num_blocks):
            raise CacheFullError(
                f"KV cache full: {num_blocks} blocks needed, {self.num_free} free of {self.num_blocks}"
            )
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._unreferenced.popitem(last=False)
            self._forget(block_id)
            self.blocks[block_id].ref_count = 1
            self.blocks[block_id].generation += 1
            block_ids.append(block_id)
        return block_ids

    def evict_cached(self) -> int:
        """Forget the KV of every unreferenced block, so that no later prompt reuses it and every old
        handle on it is invalid; returns how many blocks held some. Referenced blocks keep theirs."""
        cached = [i for i in self._unreferenced if self.blocks[i].parent_hash is not None]
        for block_id in cached:
            self._forget(block_id)
            self.blocks[block_id].generation += 1
        return len(cached)

    def num_free_empty(self, limit: int) -> int:
        """How many of the next blocks `allocate` hands out (at most `limit`) hold no reusable KV, so that
        taking them evicts nothing."""
        ahead = itertools.islice(self._unreferenced, limit)
        return sum(1 for _ in itertools.takewhile(lambda i: self.blocks[i].parent_hash is None, ahead))

    def acquire(self, block_id: int) -> None:
        """Take one more reference on a block (sharing it)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._unreferenced[block_id]
        block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; unreferenced blocks keep their KV until evicted."""
        for block_id in reversed(block_ids):  # a sequence's tail goes first, so prefixes live longest
            block = self.blocks[block_id]
            assert block.ref_count > block.pin_count, f"block {block_id} released more than acquired"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._unreferenced[block_id] = None

    @contextmanager
    def hold(self, block_ids: list[int]) -> Iterator[None]:
        """A temporary reference on each block for the duration of the `with`, released on any exit."""
        taken: list[int] = []
        try:
            for block_id in block_ids:
                self.acquire(block_id)
                taken.append(block_id)
            yield
        finally:
            self.release(taken)

    def discard(self, block_ids: list[int]) -> None:
        """Give back private blocks whose KV is not wanted: unrecorded, they are the next handed out, in
        the order given, so taking and discarding blocks leaves the free list as it was."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.pin_count == 0, f"block {block_id} is shared"
            self._forget(block_id)
            block.ref_count = 0
            self._unreferenced[block_id] = None
            self._unreferenced.move_to_end(block_id, last=False)

    def unrecord(self, block_id: int) -> None:
        """Declare that a block held by the caller no longer holds reusable KV."""
        assert self.blocks[block_id].ref_count > 0
        self._forget(block_id)

    def pin(self, block_ids: list[int]) -> None:
        """A reference that marks the blocks as kept on purpose (a retained chunk)."""
        for block_id in block_ids:
            self.acquire(block_id)
            self.blocks[block_id].pin_count += 1

    def unpin(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.pin_count > 0, f"block {block_id} is not pinned"
            block.pin_count -= 1
        self.release(block_ids)

    def record(self, block_id: int, parent_hash: int, token_ids: list[int]) -> None:
        """Declare that `block_id` holds the exact KV of `token_ids` following the prefix `parent_hash`."""
        block = self.blocks[block_id]
        assert block.ref_count > 0 and len(token_ids) <= self.block_size
        if block.parent_hash is not None:
            self._forget(block_id)
        block.parent_hash = parent_hash
        block.token_ids = list(token_ids)
        self._children.setdefault(parent_hash, set()).add(block_id)
        if len(token_ids) == self.block_size:
            block.hash = chain_hash(parent_hash, token_ids)
            self._by_hash.setdefault(block.hash, block_id)

    def match_prefix(self, token_ids: list[int], max_tokens: int | None = None) -> PrefixMatch:
        """The longest run of `token_ids` (at most `max_tokens`) whose exact KV is already held."""
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        bs = self.block_size
        shared: list[int] = []
        parent = ROOT_HASH
        while (len(shared) + 1) * bs <= limit:
            piece = token_ids[len(shared) * bs : (len(shared) + 1) * bs]
            block_id = self._by_hash.get(chain_hash(parent, piece))
            if (
                block_id is None or self.blocks[block_id].token_ids != piece
            ):  # the ids guard against collisions
                break
            shared.append(block_id)
            parent = self.blocks[block_id].hash  # type: ignore[assignment]
        start = len(shared) * bs
        copy_from, num_copy = self._best_partial(parent, token_ids[start : min(start + bs, limit)])
        self.lookup_tokens += len(token_ids)
        self.hit_tokens += start + num_copy
        return PrefixMatch(shared, copy_from, num_copy)

    def _best_partial(self, parent: int, piece: list[int]) -> tuple[int | None, int]:
        best, best_len = None, 0
        for block_id in self._children.get(parent, ()):
            held = self.blocks[block_id].token_ids
            n = 0
            for a, b in zip(held, piece, strict=False):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = block_id, n
        return best, best_len

    def _forget(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.parent_hash is None:
            return
        self._children[block.parent_hash].discard(block_id)
        if not self._children[block.parent_hash]:
            del self._children[block.parent_hash]
        if block.hash is not None and self._by_hash.get(block.hash) == block_id:
            del self._by_hash[block.hash]
        block.parent_hash, block.hash, block.token_ids = None, None, []

    def check_invariants(self) -> None:
        """Assert the bookkeeping is coherent (used by tests)."""
        for block in self.blocks:
            assert block.ref_count >= block.pin_count >= 0
            assert (block.ref_count == 0) == (block.block_id in self._unreferenced)
        for h, block_id in self._by_hash.items():
            assert self.blocks[block_id].hash == h
