"""The paged engine computes exactly what a plain full forward computes."""

import random

import pytest
import torch

from kvchat.engine import paged_attention
from kvchat.engine.engine import Engine
from kvchat.engine.paged_attention import MAX_RUNS, slot_runs
from tests.support.tiny_models import KINDS, make_tiny_model


@pytest.fixture(scope="module", params=KINDS)
def model(request):
    return make_tiny_model(request.param)


def full_logits(model, token_ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([token_ids])).logits[0]  # (T, V)


def random_ids(n, seed=0, vocab=512):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
def test_prefill_and_decode_equal_full_forward(model, block_size):
    engine = Engine(model, kv_memory_bytes=1 << 22, block_size=block_size, prefill_chunk=7)
    ids = random_ids(40)
    ref = full_logits(model, ids + [5, 6, 7])
    seq = engine.start(ids)
    got = engine.compute(seq, all_logits=True)
    torch.testing.assert_close(got, ref[:40], atol=1e-4, rtol=0)
    for i, token in enumerate([5, 6, 7]):
        engine.extend(seq, [token])
        last = engine.compute(seq)
        assert (last - ref[40 + i]).abs().max() <= 1e-4
    engine.free(seq)
    engine.blocks.check_invariants()
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_shared_prefix_computes_only_the_tail(model):
    engine = Engine(model, kv_memory_bytes=1 << 22, block_size=4, prefill_chunk=512)
    first = random_ids(30, seed=1)
    seq = engine.start(first)
    engine.compute(seq)
    second = first[:22] + random_ids(9, seed=2)
    seq2 = engine.start(second)
    assert seq2.num_computed == 22  # 5 shared blocks + 2 tokens copied from a partly matching block
    assert seq2.block_table[:5] == seq.block_table[:5]
    last = engine.compute(seq2)
    assert (last - full_logits(model, second)[-1]).abs().max() <= 1e-4


def test_all_cached_prompt_still_yields_logits(model):
    engine = Engine(model, kv_memory_bytes=1 << 22, block_size=4, prefill_chunk=512)
    ids = random_ids(16, seed=3)
    seq = engine.start(ids)
    engine.compute(seq)
    engine.free(seq)
    again = engine.start(ids)
    assert again.num_computed == 15
    last = engine.compute(again)
    assert (last - full_logits(model, ids)[-1]).abs().max() <= 1e-4


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("lean_decode", [True, False])
@pytest.mark.parametrize("views_from", [0, 10_000])
def test_sequences_decoding_in_turn_equal_full_forward(
    model, block_size, lean_decode, views_from, monkeypatch
):
    """Two sequences decoding in turn take blocks in turn, so each lies in several runs of blocks
    (block size 4) or more than MAX_RUNS (1); attention reads each from the pool alone, in place run by
    run (fp32 from VIEWS_FROM positions) or copied: the logits are still a full forward's."""
    monkeypatch.setattr(paged_attention, "VIEWS_FROM", views_from)
    engine = Engine(
        model, kv_memory_bytes=1 << 22, block_size=block_size, prefill_chunk=512, lean_decode=lean_decode
    )
    ids = {"a": random_ids(20, seed=4), "b": random_ids(25, seed=5)}
    seqs = {name: engine.start(tokens) for name, tokens in ids.items()}
    for seq in seqs.values():
        engine.compute(seq)
    for step in range(20):
        for name, seq in seqs.items():
            token = 7 + step
            engine.extend(seq, [token])
            ids[name].append(token)
            assert (engine.compute(seq) - full_logits(model, ids[name])[-1]).abs().max() <= 1e-4
    for name, seq in seqs.items():  # several new tokens at once, as speculation's drafts
        engine.extend(seq, [3, 4, 5])
        ids[name] += [3, 4, 5]
        got = engine.compute(seq, all_logits=True)  # (3, V)
        assert (got - full_logits(model, ids[name])[-3:]).abs().max() <= 1e-4
    runs = [len(slot_runs(seq.block_table, block_size, seq.num_computed)) for seq in seqs.values()]
    assert min(runs) > (MAX_RUNS if block_size == 1 else 1)


def test_rerotated_layer0_keys_equal_keys_computed_at_new_positions(model):
    from kvchat.engine.rope import KeyRotation

    engine = Engine(model, kv_memory_bytes=1 << 22, block_size=4, prefill_chunk=512)
    chunk = random_ids(10, seed=7)
    prefix_a, prefix_b = random_ids(3, seed=8), random_ids(13, seed=9)
    seq_a, seq_b = engine.start(prefix_a + chunk), engine.start(prefix_b + chunk)
    engine.compute(seq_a)
    engine.compute(seq_b)
    keys_a, _ = engine.read_kv(seq_a, 3, 13)
    keys_b, _ = engine.read_kv(seq_b, 13, 23)
    moved = KeyRotation(model).rotate_(keys_a, 10)
    torch.testing.assert_close(moved[0], keys_b[0], atol=1e-5, rtol=1e-5)  # layer 0 sees no context
    assert (moved[1] - keys_b[1]).abs().max() > 1e-3  # deeper layers did attend to another prefix
