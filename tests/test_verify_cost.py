"""What a verification of drafts costs on each decode path (`Engine.verify_cost`), and the shortest
prompt-lookup match that pays for it."""

import pytest
import torch

from kvchat.engine.engine import Engine
from kvchat.engine.speculate import paying_ngram
from kvchat.linears.bf16_linears import TiledLinear, UpcastLinear
from kvchat.native import kernels
from tests.support.tiny_models import make_tiny_model


@pytest.mark.parametrize("tiled", [True, False])
def test_matches_must_be_longer_at_long_context_in_bf16(tiled, monkeypatch):
    """Each draft's check reads the whole context, so drafts after a short match, which seldom hold,
    pay after ~50 tokens but not after ~4,000. On oneDNN's packed linears a draft is nearly free and
    one-token matches pay at first; kvchat's bf16 kernel pays products every four rows, and its token
    is little else, so only three-token matches pay; where oneDNN takes no bf16, a few rows cost nearly
    a token each, so only three-token matches pay either."""
    if not tiled:
        monkeypatch.setattr(kernels, "_build", lambda: (False, "not built in this test"))
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    engine = Engine(model, kv_memory_bytes=1 << 20, block_size=16, prefill_chunk=64)
    assert engine.decode_path.startswith("lean step")
    if tiled and not any(isinstance(m, TiledLinear) for m in model.modules()):
        pytest.skip("kvchat's bf16 kernel is not built on this machine")
    if tiled:
        assert paying_ngram(lambda k: engine.verify_cost(k, 50)) == 3
        assert paying_ngram(lambda k: engine.verify_cost(k, 4_000)) == 3
    elif any(isinstance(m, UpcastLinear) for m in model.modules()):  # oneDNN takes no bf16 on this CPU
        assert engine.verify_cost(4, 50) > 3
        assert paying_ngram(lambda k: engine.verify_cost(k, 50)) == 3
    else:
        assert paying_ngram(lambda k: engine.verify_cost(k, 50)) == 1
        assert paying_ngram(lambda k: engine.verify_cost(k, 4_000)) == 2


@pytest.mark.parametrize(("mode", "per_draft", "per_1k"), [("int4", 0.265, 0.04), ("int8", 0.2, 0.05)])
def test_layers_on_kvchats_quantized_kernels_make_drafts_dearer(mode, per_draft, per_1k):
    """kvchat's int4/int8 kernels read one row's weights at the bandwidth but pay integer products
    for each further row, so a draft costs ~0.2-0.27 of a token there against oneDNN bf16's ~0.03:
    only three-token matches pay."""
    from kvchat.models.quantize import quantize_model

    model = make_tiny_model("llama", dtype=torch.bfloat16)
    quantize_model(model, mode)
    if not any(getattr(module, "kernel", None) == "kvchat" for module in model.modules()):
        pytest.skip("kvchat's quantized kernels are not built on this machine")
    engine = Engine(model, kv_memory_bytes=1 << 20, block_size=16, prefill_chunk=64)
    assert engine.verify_cost(4, 50) == pytest.approx(1 + 4 * (per_draft + 0.05 * per_1k))
    assert paying_ngram(lambda k: engine.verify_cost(k, 50)) == 3


def test_fp32_on_kvchats_kernel_checks_drafts_for_a_share_of_a_token_each():
    """kvchat's fp32 kernel reads a few rows' weights once, as one row's (MKL's product over a few rows
    read them at half its one-row rate: a check cost ~1.7 tokens before any draft)."""
    model = make_tiny_model("llama", dtype=torch.float32)
    engine = Engine(model, kv_memory_bytes=1 << 20, block_size=16, prefill_chunk=64)
    if not any(isinstance(m, TiledLinear) for m in model.modules()):
        pytest.skip("kvchat's fp32 kernel is not built on this machine")
    assert engine.verify_cost(4, 1000) == pytest.approx(1 + 4 * (0.13 + 0.015))
    assert engine.verify_cost(0, 50) == 1.0
