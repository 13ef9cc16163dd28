"""What a verification of drafts costs on each decode path (`Engine.verify_cost`), and the shortest
prompt-lookup match that pays for it."""

import pytest
import torch

from kvchat.engine.engine import Engine
from kvchat.engine.speculate import paying_ngram
from tests.tiny_models import make_tiny_model


def test_one_token_matches_stop_paying_at_long_context_in_bf16():
    """Each draft's check reads the whole context, so drafts after a one-token match, which seldom
    hold, pay after ~50 tokens but not after ~4,000."""
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    engine = Engine(model, kv_memory_bytes=1 << 20, block_size=16, prefill_chunk=64)
    assert engine.decode_path.startswith("lean step")
    assert paying_ngram(lambda k: engine.verify_cost(k, 50)) == 1
    assert paying_ngram(lambda k: engine.verify_cost(k, 4_000)) == 2


@pytest.mark.parametrize(("mode", "per_draft", "ngram"), [("int4", 0.16, 3), ("int8", 0.13, 2)])
def test_layers_on_kvchats_quantized_kernels_make_drafts_dearer(mode, per_draft, ngram):
    """kvchat's int4/int8 kernels read one row's weights at the bandwidth but pay integer products
    for each further row, so a draft costs ~0.13-0.16 of a token there against bf16's ~0.03: only
    longer matches pay."""
    from kvchat.models.quantize import quantize_model

    model = make_tiny_model("llama", dtype=torch.bfloat16)
    quantize_model(model, mode)
    if not any(getattr(module, "kernel", None) == "kvchat" for module in model.modules()):
        pytest.skip("kvchat's quantized kernels are not built on this machine")
    engine = Engine(model, kv_memory_bytes=1 << 20, block_size=16, prefill_chunk=64)
    assert engine.verify_cost(4, 50) == pytest.approx(1 + 4 * (per_draft + 0.05 * 0.04))
    assert paying_ngram(lambda k: engine.verify_cost(k, 50)) == ngram
