"""The rescored output layer: int4 over the vocabulary, its highest logits a row equal to the exact
layer's, and the model's greedy tokens those of the exact layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvchat.linears.quantized_linears import Int4Linear, Int8Linear
from kvchat.linears.rescored_head import RescoredHead
from kvchat.models import quantized_cache
from kvchat.models.quantize import quantize_model
from kvchat.native import kernels
from tests.support.tiny_models import make_tiny_model

VOCAB, HIDDEN = 2048, 64
PATHS = ["kvchat", "torch"]  # kvchat::rescore_top, or torch's ops where it is not built


def head(num_exact: int = 64) -> tuple[RescoredHead, nn.Parameter]:
    torch.manual_seed(0)
    linear = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.bfloat16)
    return RescoredHead(Int4Linear.from_linear(linear), linear.weight, num_exact), linear.weight


def take_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "torch":
        monkeypatch.setattr(kernels, "rescore_top", lambda: None)
    elif kernels.rescore_top() is None:
        pytest.skip(f"kvchat's kernels are not built: {kernels.build_error()}")


@pytest.mark.parametrize("path", PATHS)
def test_the_highest_logits_are_the_exact_layers_and_the_others_int4s(path, monkeypatch) -> None:
    take_path(path, monkeypatch)
    rescored, weight = head()
    x = torch.randn(3, HIDDEN, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = rescored(x).float()  # (3, V)
        coarse = rescored.coarse(x).float()
        exact = F.linear(x, weight).float()
    top = coarse.topk(64, dim=-1).indices  # (3, 64)
    highest = torch.zeros_like(got, dtype=torch.bool).scatter_(1, top, True)
    torch.testing.assert_close(got[highest], exact[highest], rtol=2**-7, atol=0)  # bf16 rounding
    assert not torch.allclose(coarse[highest], exact[highest], rtol=2**-7, atol=0)  # int4 differs
    # kvchat's kernel may take a few more than the 64 highest (a bucket's worth), torch's exactly those
    changed = got != coarse
    assert torch.allclose(got[changed], exact[changed], rtol=2**-7, atol=0)
    assert changed.sum(-1).max() <= (64 if path == "torch" else 128)


@pytest.mark.parametrize("path", PATHS)
def test_its_greedy_tokens_are_the_exact_layers_where_int4_alone_gets_some_wrong(path, monkeypatch) -> None:
    take_path(path, monkeypatch)
    rescored, weight = head(num_exact=32)
    x = torch.randn(400, HIDDEN, dtype=torch.bfloat16)
    with torch.inference_mode():
        exact = F.linear(x, weight).float().argmax(-1)  # (400,)
        coarse = rescored.coarse(x).float().argmax(-1)
        got = torch.cat([rescored(row[None]) for row in x]).float().argmax(-1)  # a row at a time, as decode
    assert torch.equal(got, exact)
    assert not torch.equal(coarse, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kvchats_kernel_takes_nan_and_infinity_among_the_highest(dtype) -> None:
    rescore = kernels.rescore_top()
    if rescore is None:
        pytest.skip(f"kvchat's kernels are not built: {kernels.build_error()}")
    torch.manual_seed(0)
    weight = torch.randn(1000, 48, dtype=dtype)  # K not a multiple of a line's values: a scalar tail
    hidden = torch.randn(2, 48, dtype=dtype)
    logits = torch.randn(2, 1000, dtype=dtype)
    logits[0, 7], logits[0, 8], logits[0, 9] = float("nan"), float("inf"), float("-inf")
    logits[1] = 1.0  # all equal: every one is among the highest
    rescore(logits, weight, hidden, 10)
    exact = hidden.float() @ weight.float().T  # (2, 1000)
    torch.testing.assert_close(logits[0, 7:9].float(), exact[0, 7:9], rtol=2**-7, atol=1e-5)
    assert logits[0, 9] == float("-inf")  # the lowest
    torch.testing.assert_close(logits[1].float(), exact[1], rtol=2**-7, atol=1e-5)


def test_a_rows_logits_are_the_same_alone_and_among_many() -> None:
    if kernels.rescore_top() is None:
        pytest.skip(f"kvchat's kernels are not built: {kernels.build_error()}")
    rescored, _ = head()
    x = torch.randn(1, 40, HIDDEN, dtype=torch.bfloat16)  # 40 rows gathering 64 each: more than the layer
    with torch.inference_mode():
        together = rescored(x)
        assert together.shape == (1, 40, VOCAB)
        assert all(torch.equal(rescored(x[:, i : i + 1])[0, 0], together[0, i]) for i in range(40))


def test_int4_modes_rescore_a_tied_output_layer_and_keep_an_untied_one_int8() -> None:
    for mode in ("int4", "int4-g128"):
        tied = make_tiny_model("qwen2", dtype=torch.bfloat16)
        report = quantize_model(tied, mode)
        assert report.rescored == ["lm_head"] and isinstance(tied.lm_head, RescoredHead)
        assert tied.lm_head.weight is tied.get_input_embeddings().weight
    int8 = make_tiny_model("qwen2", dtype=torch.bfloat16)
    assert quantize_model(int8, "int8").rescored == [] and isinstance(int8.lm_head, Int8Linear)
    untied = make_tiny_model("qwen2", dtype=torch.bfloat16)
    untied.lm_head = nn.Linear(64, 512, bias=False, dtype=torch.bfloat16)
    assert quantize_model(untied, "int4").rescored == [] and isinstance(untied.lm_head, Int8Linear)
    odd = make_tiny_model("qwen2", vocab_size=520, dtype=torch.bfloat16)  # int4 takes rows in 16s
    assert quantize_model(odd, "int4").rescored == [] and isinstance(odd.lm_head, Int8Linear)
    with pytest.raises(ValueError, match="tied"):
        quantize_model(make_tiny_model("qwen2", dtype=torch.bfloat16), "int8", head_mode="rescored")


def test_a_kept_rescored_layer_reads_back_on_the_models_own_embedding() -> None:
    quantized = make_tiny_model("llama", dtype=torch.bfloat16)
    path = quantized_cache.cache_path(quantized, "int4")
    report = quantize_model(quantized, "int4")
    quantized.lm_head.num_exact = 16  # fewer than the tiny vocabulary, which 1,024 would cover whole
    quantized_cache.save(quantized, report, path)
    fresh = make_tiny_model("llama", dtype=torch.bfloat16)
    assert quantized_cache.load(fresh, path, "int4") == report
    assert isinstance(fresh.lm_head, RescoredHead) and fresh.lm_head.num_exact == 16
    assert fresh.lm_head.weight is fresh.get_input_embeddings().weight
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(fresh.lm_head(x), quantized.lm_head(x))
