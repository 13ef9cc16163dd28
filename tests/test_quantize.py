"""Weight-only int8/int4 linears against dequantized reference matmuls, on layers and tiny models."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kvchat.linears import int4_rounding
from kvchat.linears.quantized_linears import GROUP_SIZE, Int4Linear, Int8Linear
from kvchat.models.quantize import QUANTIZE_MODES, quantize_model
from kvchat.settings_schema import all_settings
from tests.support.tiny_models import make_tiny_model

LAYER_KINDS = (Int8Linear, Int4Linear)


def reference(layer: Int8Linear | Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """The quantized weight dequantized in fp32, times the input."""
    out = x.float() @ layer.dequantized_weight().T  # (..., N)
    return out if layer.bias is None else out + layer.bias.float()


def exactly_held_input(*shape: int) -> torch.Tensor:
    """Values every kernel sees unrounded: bf16 holds them, and so does int8 with one scale per group
    of 32 (kvchat's int4 kernel quantizes its input so): small integers times a power of two, each
    group's largest magnitude 127."""
    values = torch.randint(-127, 128, shape).reshape(-1, GROUP_SIZE)  # (groups, 32)
    values[:, 0] = 127
    return (values * 2.0**-6).reshape(shape)


@pytest.mark.parametrize("kind", LAYER_KINDS)
@pytest.mark.parametrize("leading", [(), (5,), (2, 3)])
def test_quantized_linear_equals_its_dequantized_matmul(kind: type, leading: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True)
    layer = kind.from_linear(linear)
    x = exactly_held_input(*leading, 256)
    out = layer(x)
    assert out.shape == (*leading, 96) and out.dtype == torch.float32
    expected = reference(layer, x)
    # The kernels round their output to bf16: 2^-8 relative, and accumulate in another order.
    torch.testing.assert_close(out, expected, rtol=2**-7, atol=2**-8 * float(expected.abs().max()))
    assert torch.equal(layer(x.to(torch.bfloat16)), out.to(torch.bfloat16))  # bf16 in, bf16 out


def test_int8_weight_is_within_half_a_step_of_the_original() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(128, 64, bias=False)
    weight = linear.weight.detach().clone()  # (N, K)
    error = (Int8Linear.from_linear(linear).dequantized_weight() - weight).abs()
    assert torch.equal(linear.weight, weight)  # quantizing works on a copy, even of fp32 weights
    step = weight.abs().amax(dim=1, keepdim=True) / 127  # (N, 1)
    # Half a step of rounding, plus bf16's rounding of the scale and of the kernel's output.
    assert bool((error <= 0.5 * step + 0.02 * weight.abs().amax()).all())
    assert float(error.mean()) < float(0.3 * step.mean())


def min_max_int4(weight: torch.Tensor, group: int) -> torch.Tensor:
    """Each group of the weight rounded to 16 levels from its min to its max (scale and zero in bf16)."""
    groups = weight.reshape(weight.shape[0], -1, group)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scales = ((high - low) / 15).clamp(min=1e-8).bfloat16().float()
    zeros = (low + 8 * scales).bfloat16().float()
    codes = ((groups - zeros) / scales + 8).round().clamp(0, 15)
    return ((codes - 8) * scales + zeros).reshape(weight.shape)


def outlying_weight() -> torch.Tensor:
    torch.manual_seed(1)
    weight = nn.Linear(256, 64, bias=False).weight.detach().clone()
    weight[:, ::37] *= 6  # an outlier in most groups
    return weight


def rounded(weight: torch.Tensor, group: int, nested: bool) -> torch.Tensor:
    """The weight as int4_rounding gives it back, in fp32."""
    codes, scales = int4_rounding.round_groups(weight.reshape(weight.shape[0], -1, group), nested)
    step, low = scales.values()  # (N, K/G) each
    return (codes.float() * step[..., None] + low[..., None]).reshape(weight.shape)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_ranges_are_searched_for_less_error_than_min_to_max(group: int) -> None:
    """Each group's error is at most that of its full range; with an outlier in a group, clipping it
    serves the other 31 (127) weights: less error in all."""
    weight = outlying_weight()

    def group_errors(values: torch.Tensor) -> torch.Tensor:
        return (values - weight).square().reshape(64, -1, group).sum(-1)

    searched, full = group_errors(rounded(weight, group, False)), group_errors(min_max_int4(weight, group))
    assert bool((searched <= full * (1 + 1e-4)).all())
    assert float(searched.sum()) < 0.9 * float(full.sum())


def test_nested_scales_cost_almost_no_error() -> None:
    """Scales as 8-bit codes under a bf16 scale per row: each group's levels move, and its codes are
    chosen against them, so the weight's error stays what bf16 scales and zeros give, also where a row's
    groups span 30x in size (SmolLM2's stay within 10x: 0.006% of groups beyond)."""
    weight = outlying_weight()
    plain, nested = ((rounded(weight, 32, n) - weight).square().sum() for n in (False, True))
    assert float(nested) < 1.02 * float(plain)
    torch.manual_seed(2)
    sizes = torch.exp(-torch.rand(64, 64, 1) * math.log(30))  # each group's size, 1/30 to 1
    uneven = (torch.randn(64, 64, 32) * sizes).reshape(64, 2048)
    plain, nested = ((rounded(uneven, 32, n) - uneven).square().sum() for n in (False, True))
    assert float(nested) < 1.02 * float(plain)
    layer = Int4Linear.from_linear(nn.Linear(256, 64), group_size=32)
    assert layer.nested == (layer.kernel == "kvchat") and layer.params.dtype == (
        torch.uint8 if layer.nested else torch.bfloat16
    )


@pytest.mark.parametrize("nested", [False, True])
def test_rounding_keeps_the_weights_device(nested: bool) -> None:
    """Codes and scales are made where the weights are (on a GPU, torch's kernel packs them there)."""
    codes, scales = int4_rounding.round_groups(torch.zeros(16, 9, 32, device="meta"), nested)
    assert codes.device.type == "meta"
    assert all(getattr(scales, name).device.type == "meta" for name in scales.__dataclass_fields__)


def test_shapes_the_kernels_cannot_take_are_refused() -> None:
    with pytest.raises(ValueError, match="divisible by 16"):
        Int8Linear.from_linear(nn.Linear(24, 16))  # the int8 kernel crashes on such rows
    with pytest.raises(ValueError, match=f"divisible by {GROUP_SIZE}"):
        Int4Linear.from_linear(nn.Linear(48, 16))
    with pytest.raises(ValueError, match="out_features by 16"):
        Int4Linear.from_linear(nn.Linear(64, 24))


def test_the_setting_offers_the_modes_quantize_model_runs() -> None:
    assert all_settings()["model.quantize"].spec.choices == QUANTIZE_MODES


def test_quantize_model_leaves_odd_layers_and_the_embedding_alone() -> None:
    model = nn.Sequential(nn.Embedding(10, 64), nn.Linear(64, 64), nn.Linear(64, 24), nn.Linear(64, 48))
    report = quantize_model(model, "int4")
    assert report.quantized == ["1", "3"] and report.refused == ["2"] and not report.kept_from_file
    assert isinstance(model[0], nn.Embedding) and isinstance(model[2], nn.Linear)
    assert isinstance(model[1], Int4Linear) and isinstance(model[3], Int4Linear)
    assert quantize_model(model, "none").num_replaced == 0
    with pytest.raises(ValueError, match="int2"):
        quantize_model(model, "int2")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v carry a bias
@pytest.mark.parametrize("mode", ["int8", "int4", "int4-g128"])
def test_a_quantized_tiny_model_keeps_its_logits_and_generates(kind: str, mode: str) -> None:
    plain = make_tiny_model(kind, dtype=torch.bfloat16)
    quantized = make_tiny_model(kind, dtype=torch.bfloat16)
    report = quantize_model(quantized, mode)
    assert report.num_replaced == 2 * 7 + 1 and not report.refused  # 7 linears a layer, and lm_head
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))  # (1, T)
    with torch.inference_mode():
        expected = plain(input_ids=ids).logits.float().log_softmax(-1)  # (1, T, V)
        got = quantized(input_ids=ids).logits.float().log_softmax(-1)
        kl = (expected.exp() * (expected - got)).sum(-1).mean()
        out = quantized.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert float(kl) < (1e-4 if mode == "int8" else 2e-3), float(kl)  # measured: 2e-6, 2e-4, 3e-4
    assert float((expected.argmax(-1) == got.argmax(-1)).float().mean()) >= 0.9
    assert out.shape == (1, 46)


@pytest.mark.slow
def test_packaged_smollm2_in_int4_runs_on_its_own_q4_1_values() -> None:
    from kvchat.config import ModelSettings
    from kvchat.models.loader import load_model

    plain = load_model(ModelSettings(dtype="bf16", device="cpu", threads=1))
    int4 = load_model(ModelSettings(dtype="bf16", device="cpu", threads=1, quantize="int4"))
    report = int4.quantization
    assert report is not None and len(report.kept_from_file) == 30 * 7 and not report.refused
    assert report.quantized == report.rescored == ["lm_head"]  # tied to the Q8_0 embedding
    assert int4.fingerprint != plain.fingerprint  # KV saved by one is refused by the other
    tokenizer = int4.tokenizer
    # not "What is the capital of France?": its first token is a tie between "The" and "L" (one bf16
    # step apart in the logits, 25.375 and 25.25), which any change in a kernel's sums may turn over
    messages = [{"role": "user", "content": "Name the capital city of France."}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = encoded["input_ids"]  # (1, T)
    with torch.inference_mode():
        expected = plain.model(input_ids=ids).logits.float().log_softmax(-1)  # (1, T, V)
        got = int4.model(input_ids=ids).logits.float().log_softmax(-1)
        answer = int4.model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    assert float((expected.exp() * (expected - got)).sum(-1).mean()) < 0.02
    assert "Paris" in tokenizer.decode(answer)


def test_int4_g128_takes_the_largest_group_of_at_most_128_that_divides_the_inputs() -> None:
    model = nn.Sequential(nn.Linear(1536, 32), nn.Linear(576, 32), nn.Linear(96, 32))  # SmolLM2's 576
    report = quantize_model(model, "int4-g128")
    assert report.quantized == ["0", "1", "2"] and report.mode == "int4-g128"
    assert [layer.group_size for layer in model] == [128, 64, 32]
    assert model[0].params.numel() == 32 * 1536 // 128 * 2  # a scale and zero a group
    for layer, linear_in in zip(model, (1536, 576, 96), strict=True):
        x = torch.randn(2, linear_in)
        expected = x.double() @ layer.dequantized_weight().double().T + layer.bias.double()
        torch.testing.assert_close(layer(x).double(), expected, rtol=2**-7, atol=1e-2)


def test_quantize_model_reports_each_layer_to_progress() -> None:
    heard: list[tuple[int, int]] = []
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 24), nn.Linear(64, 32))  # 24 rows: refused
    quantize_model(model, "int4-g128", progress=lambda done, total: heard.append((done, total)))
    assert heard == [(0, 3), (1, 3), (2, 3), (3, 3)]


def test_only_int4_keeps_a_files_layers_whose_groups_are_of_32() -> None:
    asked: list[str] = []

    def from_file(name: str, linear: nn.Linear) -> nn.Module | None:
        asked.append(name)
        return None

    quantize_model(nn.Sequential(nn.Linear(256, 32)), "int4-g128", from_file=from_file)
    assert asked == []
    quantize_model(nn.Sequential(nn.Linear(256, 32)), "int4", from_file=from_file)
    assert asked == ["0"]


def test_the_fingerprint_records_the_quantization() -> None:
    from kvchat.models.loader import compute_fingerprint, quantization_tag
    from kvchat.models.quantize import QuantizeReport

    config = make_tiny_model("llama").config
    tags = ["none", "int8", "int4", "int4+file", "int4-g128", "int4+nested"]
    assert len({compute_fingerprint("m", config, tag) for tag in tags}) == len(tags)
    # Unquantized: the fingerprint of before, so state files saved earlier still load.
    assert compute_fingerprint("m", config) == compute_fingerprint("m", config, "none")
    assert quantization_tag(None) == "none"
    assert quantization_tag(QuantizeReport("int4", kept_from_file=["x"])) == "int4+file"
    model = nn.Sequential(nn.Linear(256, 32), nn.Linear(32, 64))
    report = quantize_model(model, "int4")
    nested = model[0].kernel == "kvchat"  # groups of 32 on kvchat's kernel nest their scales
    assert report.nested == (["0", "1"] if nested else [])
    assert quantization_tag(report) == ("int4+nested" if nested else "int4")


def test_a_torch_without_the_kernels_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvchat.errors import ModelLoadError
    from kvchat.models import quantize

    monkeypatch.setitem(quantize.KERNELS, ("int4", "cpu"), ("_no_such_kernel",))
    model = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(ModelLoadError, match="_no_such_kernel"):
        quantize_model(model, "int4")
    assert isinstance(model[0], nn.Linear)


def test_info_says_how_the_weights_are_stored_and_whose_kernels_run_them() -> None:
    from kvchat.linears.bf16_linears import PackedLinear, fallback_kind, onednn_packs_bf16, tile_linears_
    from kvchat.models.info import describe_quantization
    from kvchat.native import kernels

    ours = "kvchat" if kernels.int4_linear() is not None else "torch"
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    assert describe_quantization(model) == "none"
    bf16 = make_tiny_model("llama", dtype=torch.bfloat16)
    tiled = tile_linears_(bf16) > 0  # where kvchat's bf16 kernel is built
    if tiled:
        assert describe_quantization(bf16) == "none (bf16 on kvchat's kernel)"
    kind = fallback_kind(onednn_packs_bf16())  # what this CPU runs where kvchat's kernel does not
    head = nn.Linear(64, 512, dtype=torch.bfloat16)
    bf16.lm_head = PackedLinear(head) if kind is PackedLinear else kind.of(head)
    other = "oneDNN" if kind is PackedLinear else "torch"
    assert describe_quantization(bf16) == (
        f"none (bf16 on kvchat and {other}'s kernels)" if tiled else f"none (bf16 on {other}'s kernel)"
    )
    quantize_model(model, "int4", head_mode="int8")
    assert describe_quantization(model) == f"int4 ({ours}'s kernels)"
    coarse = make_tiny_model("llama", dtype=torch.bfloat16)
    quantize_model(coarse, "int4-g128")  # groups of 64 where 128 does not divide the inputs
    assert describe_quantization(coarse) == f"int4-g128 ({ours}'s kernels, the output layer rescored)"
    int8 = make_tiny_model("llama", dtype=torch.bfloat16)
    quantize_model(int8, "int8")
    int8.lm_head = Int8Linear.from_linear(nn.Linear(64, 512), "torch")
    assert describe_quantization(int8) == (
        "int8 (kvchat and torch's kernels)" if ours == "kvchat" else "int8 (torch's kernels)"
    )


def test_nested_scales_are_for_kvchats_kernel_and_groups_of_32_only() -> None:
    from kvchat.linears.int4_rounding import NestedScales

    def nested(groups: int) -> NestedScales:
        return NestedScales(
            torch.ones(32, groups, dtype=torch.uint8),
            torch.zeros(32, groups, dtype=torch.int8),
            torch.ones(32, dtype=torch.bfloat16),
            torch.ones(32, dtype=torch.bfloat16),
        )

    codes = torch.randint(0, 16, (32, 256))
    with pytest.raises(ValueError, match="kvchat's kernel only"):
        Int4Linear(codes, nested(8), None, "torch")
    with pytest.raises(ValueError, match="groups of 32"):
        Int4Linear(codes, nested(4), None)  # groups of 64
