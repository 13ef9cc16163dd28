"""The block manager's bookkeeping: plain Python over ints, tested without a model."""

import pytest

from kvchat.engine import block_manager
from kvchat.engine.block_manager import ROOT_HASH, BlockManager, chain_hash
from kvchat.errors import CacheFullError


def fill(bm: BlockManager, token_ids: list[int]) -> list[int]:
    """Allocate and record blocks for `token_ids`, as a sequence's forward would."""
    bs = bm.block_size
    block_ids = bm.allocate(-(-len(token_ids) // bs))
    parent = ROOT_HASH
    for i, block_id in enumerate(block_ids):
        piece = token_ids[i * bs : (i + 1) * bs]
        bm.record(block_id, parent, piece)
        parent = chain_hash(parent, piece)
    return block_ids


def test_ref_counts_and_no_leaks():
    bm = BlockManager(8, 4)
    a = fill(bm, list(range(10)))  # 3 blocks, the last partly filled
    for block_id in a[:2]:
        bm.acquire(block_id)  # a second sequence shares the full ones
    assert [bm.blocks[b].ref_count for b in a] == [2, 2, 1]
    bm.release(a)
    bm.release(a[:2])
    bm.check_invariants()
    assert bm.num_free == 8 and bm.num_used == 0
    with pytest.raises(AssertionError):
        bm.release(a[:1])  # released more than acquired


def test_prefix_match_full_blocks_then_partial_copy():
    bm = BlockManager(8, 4)
    ids = list(range(100, 110))
    a = fill(bm, ids)
    match = bm.match_prefix(ids[:9] + [7, 7, 7])
    assert match.shared_block_ids == a[:2] and match.copy_from == a[2] and match.num_copy == 1
    assert bm.match_prefix(ids, max_tokens=9).num_tokens(4) == 9  # the cap leaves the last token
    assert bm.match_prefix([1, 2, 3, 4, 5]).num_tokens(4) == 0


def test_unreferenced_blocks_stay_findable_and_are_evicted_least_recently_released_first():
    bm = BlockManager(4, 2)
    old, new = fill(bm, [1, 2]), fill(bm, [3, 4])
    bm.release(old)
    bm.release(new)
    assert bm.num_cached == 2 and bm.match_prefix([1, 2, 9]).shared_block_ids == old
    fresh = bm.allocate(3)  # the two never-used blocks first, then the oldest release
    assert old[0] in fresh and new[0] not in fresh
    assert (
        bm.match_prefix([1, 2, 9]).shared_block_ids == []
        and bm.match_prefix([3, 4, 9]).shared_block_ids == new
    )


def test_hash_collision_cannot_serve_other_tokens(monkeypatch):
    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, token_ids: 42)  # everything collides
    bm = BlockManager(4, 2)
    fill(bm, [1, 2])
    match = bm.match_prefix([5, 6, 7])
    assert match.shared_block_ids == [] and match.num_copy == 0  # the token ids are compared too


def test_pinned_blocks_are_never_evicted():
    bm = BlockManager(3, 2)
    kept = fill(bm, [1, 2, 3, 4])
    bm.pin(kept)
    bm.release(kept)  # the sequence ends; the pin holds the blocks
    assert bm.num_pinned == 2 and bm.num_free == 1
    with pytest.raises(CacheFullError):
        bm.allocate(2)
    assert bm.match_prefix([1, 2, 3, 4, 5]).shared_block_ids == kept
    bm.unpin(kept)
    bm.check_invariants()
    assert bm.num_pinned == 0 and bm.num_free == 3


def test_reallocation_bumps_generation_and_forgets_old_contents():
    bm = BlockManager(1, 2)
    (block_id,) = fill(bm, [1, 2])
    generation = bm.blocks[block_id].generation
    bm.release([block_id])
    bm.allocate(1)
    assert bm.blocks[block_id].generation == generation + 1
    assert bm.blocks[block_id].token_ids == [] and bm.match_prefix([1, 2, 3]).num_tokens(2) == 0
