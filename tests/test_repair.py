"""Repair by deviation (selective recompute): at share 1 it is exact, at share 0 it is reposition, its
KV is never indexed as exact, and an interrupted recompute gives every block back."""

import random

import pytest
import torch

from kvchat.chunks import compose as compose_module
from kvchat.chunks.compose import RepairPolicy
from kvchat.chunks.context import ContextManager
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import RepairStrategy, ReuseMode
from kvchat.engine import blend
from kvchat.engine.engine import Engine
from kvchat.engine.sampling import SamplingParams
from tests.support.hf_tokenizers import load_smollm2_tokenizer
from tests.support.managers import repair
from tests.support.tiny_models import make_tiny_model

WORDS = "the cat sat on a mat while rain fell over quiet hills and rivers ran to the sea".split()
ONE = SamplingParams(max_tokens=1)


def text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def deviation(share: float, taper: float = 0.0) -> RepairPolicy:
    return RepairPolicy(share=share, min_tokens=0, strategy=RepairStrategy.DEVIATION, taper=taper)


def manager(model, tokenizer, mode: ReuseMode, repair: RepairPolicy) -> ContextManager:
    engine = Engine(model, kv_memory_bytes=1 << 24, block_size=4, prefill_chunk=16)
    eos = frozenset({tokenizer.eos_token_id})
    return ContextManager(engine, ChatFormat(tokenizer), tokenizer, eos, mode=mode, repair=repair)


def moved_context(model, tokenizer, mode: ReuseMode, repair: RepairPolicy) -> ContextManager:
    """Passages answered once, then reordered under another system prompt: every passage moves."""
    cm = manager(model, tokenizer, mode, repair)
    cm.set_system("first system prompt")
    ids = [cm.add_context(text(i, 24 + 3 * i)).chunk_id for i in range(3)]
    cm.set_query("what ran to the sea?")
    list(cm.infer(ONE))
    cm.set_system("a different and somewhat longer system prompt")
    cm.middle = [ids[2], ids[0], ids[1]]
    return cm


def composed_logits(cm: ContextManager):
    composed = cm.compose()
    logits = cm.engine.compute(composed.seq)  # (V,)
    return logits, composed


def full_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([token_ids])).logits[0, -1]  # (V,)


@pytest.fixture(scope="module")
def tokenizer():
    return load_smollm2_tokenizer()


@pytest.mark.parametrize("kind,taper", [("llama", 0.0), ("qwen2", 0.0), ("llama", 0.5)])
def test_share_one_equals_exact(kind, taper, tokenizer):
    model = make_tiny_model(kind, vocab_size=49152, num_layers=4)
    cm = moved_context(model, tokenizer, ReuseMode.REPAIR, deviation(1.0, taper))
    logits, composed = composed_logits(cm)
    assert composed.num_repositioned == 0 and composed.recomputed
    assert (logits - full_logits(model, composed.seq.token_ids)).abs().max() <= 1e-4


@pytest.mark.slow
def test_share_one_equals_exact_on_smollm2(smollm2):
    model, tokenizer = smollm2
    cm = moved_context(model, tokenizer, ReuseMode.REPAIR, deviation(1.0))
    logits, composed = composed_logits(cm)
    assert composed.num_repositioned == 0
    assert (logits - full_logits(model, composed.seq.token_ids)).abs().max() <= 1e-4


@pytest.mark.parametrize("num_layers", [1, 2])
def test_probing_every_layer_recomputes_every_moved_token(num_layers, tokenizer):
    model = make_tiny_model("llama", vocab_size=49152, num_layers=num_layers)
    cm = moved_context(model, tokenizer, ReuseMode.REPAIR, deviation(0.25))  # probes at layer 1
    logits, composed = composed_logits(cm)
    moved = sum(b - a for a, b in composed.repositioned)
    assert moved and len(composed.recomputed) == moved and composed.num_repositioned == 0
    assert (logits - full_logits(model, composed.seq.token_ids)).abs().max() <= 1e-4


@pytest.mark.parametrize("taper", [0.0, 0.5])
def test_share_zero_equals_reposition(taper, tokenizer):
    model = make_tiny_model("qwen2", vocab_size=49152, num_layers=4)
    repaired, _ = composed_logits(moved_context(model, tokenizer, ReuseMode.REPAIR, deviation(0.0, taper)))
    moved, composed = composed_logits(moved_context(model, tokenizer, ReuseMode.REPOSITION, deviation(0.0)))
    assert composed.num_repositioned > 0
    assert (repaired - moved).abs().max() <= 1e-5


def test_partial_share_recomputes_that_share_and_reports_it(tokenizer):
    model = make_tiny_model("llama", vocab_size=49152, num_layers=4)
    cm = moved_context(model, tokenizer, ReuseMode.REPAIR, deviation(0.25))
    result = list(cm.infer(ONE))[-1]
    moved = result.repositioned_tokens + sum(r.num_recomputed for r in result.chunks)
    recomputed = sum(r.num_recomputed for r in result.chunks)
    assert recomputed == -(-moved // 4)  # ceil(0.25 * moved)
    for report in result.chunks:
        assert report.num_reused + report.num_repositioned + report.num_computed == report.num_tokens
        assert report.num_recomputed <= report.num_computed


def test_layer_shares_narrow_from_the_share_and_keep_its_ends():
    assert repair(share=0.2).layer_shares(6) == pytest.approx([0.2] * 4)
    shares = repair(share=0.25, taper=0.5).layer_shares(6)
    assert shares == pytest.approx([0.5, 0.25**0.5 * 0.25 ** (1 / 3), 0.25 ** (7 / 6), 0.125])
    assert repair(share=1.0, taper=0.9).layer_shares(30) == [1.0] * 28
    assert repair(share=0.0, taper=0.9).layer_shares(30) == [0.0] * 28
    with pytest.raises(ValueError):
        repair(share=0.2, taper=1.0)


def test_progressive_selection_narrows_layer_by_layer(tokenizer):
    model = make_tiny_model("llama", vocab_size=49152, num_layers=6)
    policy = RepairPolicy(share=0.25, min_tokens=2, strategy=RepairStrategy.DEVIATION, taper=0.5)
    cm = moved_context(model, tokenizer, ReuseMode.REPAIR, policy)
    calls = []
    real = blend.recompute_selected

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    compose_module.recompute_selected = spy
    try:
        composed = cm.compose()
    finally:
        compose_module.recompute_selected = real
    moved = sum(b - a for a, b in composed.repositioned)
    heads = {p for a, b in composed.repositioned for p in range(a, min(b, a + 2))}
    expected = [max(len(heads), -(-round(s * moved, 9) // 1)) for s in policy.layer_shares(6)]
    assert composed.recompute_layers == expected
    (ran,) = calls
    for outer, inner in zip(ran, ran[1:], strict=False):
        assert set(inner) < set(outer)  # each layer runs a subset of the one before
    assert heads <= set(ran[-1])  # each moved chunk's first tokens run through every layer
    assert composed.recomputed == [p for p in ran[0] if any(a <= p < b for a, b in composed.repositioned)]
    cm.engine.free(composed.seq)


def test_each_moved_chunks_first_tokens_are_recomputed_within_the_share(tokenizer):
    model = make_tiny_model("llama", vocab_size=49152, num_layers=4)
    policy = repair(share=0.25, min_tokens=3, strategy=RepairStrategy.DEVIATION, taper=0.0)
    cm = moved_context(model, tokenizer, ReuseMode.REPAIR, policy)
    composed = cm.compose()
    moved = sum(b - a for a, b in composed.repositioned)
    assert len(composed.recomputed) == -(-moved // 4)
    for a, _ in composed.repositioned:
        assert {a, a + 1, a + 2} <= set(composed.recomputed)
    cm.engine.free(composed.seq)


def test_selective_kv_is_never_indexed_as_exact(tokenizer):
    model = make_tiny_model("llama", vocab_size=49152, num_layers=4)
    cm = moved_context(model, tokenizer, ReuseMode.REPAIR, deviation(0.5))
    composed = cm.compose()
    seq, blocks = composed.seq, cm.engine.blocks
    first_moved = composed.repositioned[0][0]
    assert seq.exact_limit <= first_moved
    for index, block_id in enumerate(seq.block_table):
        held = blocks.blocks[block_id].token_ids
        assert not held or index * cm.engine.block_size + len(held) <= first_moved  # recorded KV ends there
    cm.engine.free(seq)
    fresh = cm.engine.start(list(seq.token_ids))  # an exact start can share only the exact prefix
    assert fresh.num_computed <= first_moved
    cm.engine.free(fresh)


@pytest.mark.parametrize("taper", [0.0, 0.5])
def test_interrupted_recompute_gives_every_block_back(taper, tokenizer, monkeypatch):
    model = make_tiny_model("llama", vocab_size=49152, num_layers=4)
    cm = moved_context(model, tokenizer, ReuseMode.REPAIR, deviation(0.5, taper))
    blocks = cm.engine.blocks
    cm._release_live()
    free_before = blocks.num_free
    layer = model.model.layers[2]
    calls = []

    def interrupt(*args, **kwargs):
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(layer, "forward", interrupt)
    cancelled = list(cm.infer(ONE))[-1]  # Ctrl-C while composing cancels the inference cleanly
    assert cancelled.finish_reason == "cancelled" and cancelled.output_number is None
    assert calls and blocks.num_free == free_before
    blocks.check_invariants()
    monkeypatch.undo()
    result = list(cm.infer(ONE))[-1]  # still usable, and the recompute happens again
    assert sum(r.num_recomputed for r in result.chunks) > 0
    assert compose_module.recompute_selected is blend.recompute_selected


def test_chunk_table_shows_recomputed_tokens_only_when_repair_recomputed_some():
    from rich.console import Console

    from kvchat.chunks.types import ChunkReport, Role
    from kvchat.cli.views import chunk_reports_table

    def render(reports):
        console = Console(width=120, record=True)
        console.print(chunk_reports_table(reports))
        return console.export_text()

    moved = ChunkReport("abc", Role.CONTEXT, 40, 0, 34, 6, 6)
    assert "recomputed" in render([moved])
    assert "recomputed" not in render([ChunkReport("abc", Role.CONTEXT, 40, 0, 40, 0)])
