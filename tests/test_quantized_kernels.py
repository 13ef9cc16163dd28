"""kvchat's int4 and int8 kernels (`kvchat::int4_linear`, `kvchat::int8_linear`) against the layer's
weight dequantized in float64, within what rounding their input to int8 twice leaves (16 or more rows
of bf16 input run on AMX where the CPU has it, unrounded: well within), and against torch's kernels on
the same codes."""

from dataclasses import dataclass

import pytest
import torch

from kvchat.linears import int4_rounding
from kvchat.linears.int4_rounding import GroupScales, NestedScales
from kvchat.linears.quantized_linears import GROUP_SIZE, Int4Linear, Int8Linear, fuse_quantized
from kvchat.native import kernels
from kvchat.native.kernels import has_cpp_compiler

pytestmark = pytest.mark.skipif(
    not has_cpp_compiler() or kernels.tier() == "portable",
    reason="the kernels are built with a C++ compiler, for every tier but the portable one",
)


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert kernels.int4_linear() is not None, kernels.build_error()
    assert kernels.int8_linear() is not None, kernels.build_error()


@dataclass
class Weights:
    """A quantized weight's parts in float64, each (N, K): weight = scaled_codes + offsets."""

    scaled_codes: torch.Tensor  # code * scale
    offsets: torch.Tensor  # zero - 8 * scale

    @property
    def weight(self) -> torch.Tensor:
        return self.scaled_codes + self.offsets


def make_layer(
    out_features: int, in_features: int, bias: bool = False, group: int = GROUP_SIZE, nested: bool = False
) -> tuple[Int4Linear, Weights]:
    """Random codes, scales and zeros, one scale and zero per `group` inputs, or random nested scales."""
    generator = torch.Generator().manual_seed(0)
    groups = in_features // group
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator)
    scales: GroupScales | NestedScales
    if nested:
        scales = NestedScales(
            torch.randint(1, 256, (out_features, groups), generator=generator).to(torch.uint8),
            torch.randint(-127, 128, (out_features, groups), generator=generator).to(torch.int8),
            (torch.rand(out_features, generator=generator) * 1e-4 + 1e-5).to(torch.bfloat16),
            (torch.rand(out_features, generator=generator) * 1e-4).to(torch.bfloat16),
        )
    else:
        scales = GroupScales(
            (torch.rand(out_features, groups, generator=generator) * 0.02 + 1e-3).to(torch.bfloat16),
            (torch.randn(out_features, groups, generator=generator) * 0.01).to(torch.bfloat16),
        )
    bias_values = torch.randn(out_features, generator=generator).to(torch.bfloat16) if bias else None
    layer = Int4Linear(codes, scales, bias_values)
    per_group = scales.values()
    if isinstance(scales, GroupScales):  # the kernel's own sum: (code - 8) * scale + zero
        per_group = (scales.scales.float(), scales.zeros.float() - 8 * scales.scales.float())
    scales64, lows64 = (v.double().repeat_interleave(group, 1) for v in per_group)  # (N, K)
    return layer, Weights(codes.double() * scales64, lows64)


def make_kind(kind: str, out_features: int, in_features: int) -> tuple[Int4Linear | Int8Linear, Weights]:
    """A layer of random weights: "int4" (groups of 32, bf16 scales and zeros), "int4-g64", "int4-g128",
    "int4-nested" or "int8"."""
    if kind == "int8":
        return make_int8_layer(out_features, in_features)
    if kind == "int4-nested":
        return make_layer(out_features, in_features, nested=True)
    return make_layer(out_features, in_features, group=int(kind.partition("-g")[2] or GROUP_SIZE))


KINDS = ("int4", "int4-g64", "int4-g128", "int4-nested", "int8")


def make_int8_layer(out_features: int, in_features: int) -> tuple[Int8Linear, Weights]:
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (out_features, in_features), generator=generator)
    scales = (torch.rand(out_features, generator=generator) * 0.01 + 1e-3).to(torch.bfloat16)
    layer = Int8Linear(codes, scales, None)
    weight = codes.double() * scales.double()[:, None]
    return layer, Weights(weight, torch.zeros_like(weight))  # no offsets: all of it meets the input


def rounding_bound(x: torch.Tensor, weights: Weights) -> torch.Tensor:
    """How far a kernel may be from x @ W.T, (M, N): each input within 1/256 of its group's int8
    step (int4's offsets take x's exact sums), plus fp32's sums."""
    groups = x.double().reshape(x.shape[0], -1, GROUP_SIZE)  # (M, K/32, 32)
    step = groups.abs().amax(-1, keepdim=True) / 127
    per_input = (step / 256).expand_as(groups).reshape(x.shape)  # (M, K)
    return per_input @ weights.scaled_codes.abs().T + 1e-5 * x.double().abs() @ weights.weight.abs().T


def run_kernel(layer: Int4Linear | Int8Linear, x: torch.Tensor) -> torch.Tensor:
    if isinstance(layer, Int4Linear):
        return torch.ops.kvchat.int4_linear(x, layer.packed, layer.params)
    return torch.ops.kvchat.int8_linear(x, layer.codes, layer.scales)


# passes of 4 input rows, and what is left; on AMX, blocks of 16 rows, the last padded
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16, 33, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_equals_the_dequantized_matmul(rows: int, dtype: torch.dtype, kind: str) -> None:
    inputs = 384  # 12 groups of 32: nested, a block of 8 and a short one
    layer, weights = make_kind(kind, 48, inputs)
    assert layer.kernel == "kvchat"
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[0, 40] = 30.0  # one large input in its group: the others are read on its scale
    x[-1, 64:96] = 0.0  # a group of zeros: no scale to divide by
    out = run_kernel(layer, x)  # (M, N)
    assert out.dtype == torch.float32 and out.shape == (rows, 48)
    torch.testing.assert_close(layer.dequantized_weight().double(), weights.weight, rtol=0, atol=1e-7)
    expected = x.double() @ weights.weight.T
    error = (out.double() - expected).abs()
    bound = rounding_bound(x, weights)
    assert bool((error <= bound).all()), float((error - bound).max())
    # The residues' pass matters: the input rounded to int8 once is ~100x further off.
    assert float(error.max()) < 0.05 * float((once_rounded(x) @ weights.weight.T - expected).abs().max())


def once_rounded(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 with one scale per group of 32, in float64."""
    groups = x.double().reshape(x.shape[0], -1, GROUP_SIZE)
    step = (groups.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-30)
    return (torch.round(groups / step) * step).reshape(x.shape)


def test_the_layer_rounds_its_output_once_and_adds_its_bias() -> None:
    layer, weights = make_layer(32, 64, bias=True)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).float()
    out = layer(x)
    assert out.shape == (2, 3, 32) and out.dtype == torch.float32
    flat = torch.ops.kvchat.int4_linear(x.reshape(6, 64), layer.packed, layer.params)
    assert torch.equal(out, (flat + layer.bias).reshape(2, 3, 32))
    assert torch.equal(layer(x.to(torch.bfloat16)), out.to(torch.bfloat16))
    torch.testing.assert_close(layer.dequantized_weight().double(), weights.weight, rtol=0, atol=1e-7)


@pytest.mark.parametrize(("kind", "group"), [(Int4Linear, 32), (Int4Linear, 128), (Int8Linear, None)])
def test_both_kernels_compute_the_same_layer(kind: type, group: int | None) -> None:
    """The same codes and scales in kvchat's layout and in torch's multiply alike (bf16 scales and
    zeros: torch's kernel takes no nested ones)."""
    linear = torch.nn.Linear(256, 64, bias=False)
    if kind is Int4Linear:
        assert group is not None
        codes, scales = int4_rounding.round_groups(linear.weight.detach().reshape(64, -1, group))
        weights = codes.reshape(64, 256)
        ours, theirs = (Int4Linear(weights, scales, None, kernel) for kernel in ("kvchat", "torch"))
    else:
        ours, theirs = (kind.from_linear(linear, kernel) for kernel in ("kvchat", "torch"))
    expected_weight = ours.dequantized_weight()
    if kind is Int4Linear:  # torch's is read through its kernel, which rounds to bf16
        expected_weight = expected_weight.to(torch.bfloat16).float()
    assert torch.equal(expected_weight, theirs.dequantized_weight())
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    expected = x.double() @ ours.dequantized_weight().double().T
    # torch's kernels round their output to bf16; kvchat's are within their bound of the exact product
    close = {"rtol": 2**-7, "atol": 2**-8 * float(expected.abs().max())}
    torch.testing.assert_close(theirs(x).double(), expected, **close)
    torch.testing.assert_close(ours(x).double(), expected, **close)


def test_asking_for_kvchats_kernel_where_it_cannot_run_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    odd = torch.nn.Linear(48, 32)  # 48 inputs: not whole groups of 32
    assert Int8Linear.from_linear(odd).kernel == "torch"
    with pytest.raises(ValueError, match="a 32x48 weight"):
        Int8Linear.from_linear(odd, "kvchat")
    monkeypatch.setattr(kernels, "int4_linear", lambda: None)
    linear = torch.nn.Linear(64, 32)
    assert Int4Linear.from_linear(linear).kernel == "torch"
    with pytest.raises(ValueError, match="cannot run"):
        Int4Linear.from_linear(linear, "kvchat")


@pytest.mark.parametrize("inputs", [128, 2048])  # int8 rows of 64 groups and more stream
@pytest.mark.parametrize("kind", ["int4", "int4-g128", "int4-nested", "int8"])
def test_one_row_computes_each_row_as_the_rows_do(kind: str, inputs: int) -> None:
    """One input row (int4 streaming 8 tiles at once, int8's long rows 4, then the rest 4, 2 and 1 at
    a time: 15 tiles take every count) takes the same sums, in the same order, as the passes over
    several rows."""
    layer, _ = make_kind(kind, 16 * 15, inputs)
    x = torch.randn(5, inputs, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    together = run_kernel(layer, x)
    assert all(torch.equal(run_kernel(layer, x[i : i + 1])[0], together[i]) for i in range(5))


@pytest.mark.parametrize(("rows", "dtype"), [(1, torch.float32), (5, torch.float32), (40, torch.bfloat16)])
@pytest.mark.parametrize("kind", ["int4", "int4-nested", "int8"])
def test_threads_split_the_rows_without_changing_a_bit(
    kind: str, rows: int, dtype: torch.dtype, on_one_then_two_threads
) -> None:
    inputs = 2048 if kind == "int8" else 352  # int8's one row streams from 64 groups
    layer, _ = make_kind(kind, 256, inputs)
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(3)).to(dtype)
    alone, together = on_one_then_two_threads(lambda: layer(x))
    assert torch.equal(alone, together)


def test_the_kernel_refuses_a_weight_of_another_layout() -> None:
    layer, _ = make_layer(32, 64)
    with pytest.raises(RuntimeError, match="int4_linear"):
        torch.ops.kvchat.int4_linear(torch.randn(1, 96), layer.packed, layer.params)
    with pytest.raises(RuntimeError, match="int4_linear"):
        torch.ops.kvchat.int4_linear(torch.randn(1, 64), layer.packed.float(), layer.params)
    wide, _ = make_layer(32, 96)  # params for 3 groups of 32 taken as one of 96: no such span
    one_span = wide.params[:, :1].contiguous()
    with pytest.raises(RuntimeError, match="groups of 32, 64 or 128"):
        torch.ops.kvchat.int4_linear(torch.randn(1, 96), wide.packed, one_span)
    nested, _ = make_layer(32, 320, nested=True)  # 10 groups' codes, params for 9
    with pytest.raises(RuntimeError, match="nested params shape"):
        torch.ops.kvchat.int4_linear(torch.randn(1, 320), nested.packed, nested.params[:, :-32].contiguous())


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("kind", "group"), [(Int4Linear, 32), (Int4Linear, 128), (Int8Linear, None)])
def test_fused_layers_give_each_layers_output_bit_for_bit(kind: type, group: int | None, rows: int) -> None:
    """Query, key and value (gate and up) fused for the lean step: one call, each layer's own outputs."""
    torch.manual_seed(0)
    sizes = {} if group is None else {"group_size": group}
    layers = [kind.from_linear(torch.nn.Linear(2048, n), **sizes) for n in (256, 64, 64)]  # int8 streams
    x = torch.randn(rows, 2048).to(torch.bfloat16)
    apart = torch.cat([run_kernel(layer, x) for layer in layers], dim=1)
    codes, scales, bias = fuse_quantized(layers)
    op = torch.ops.kvchat.int4_linear if kind is Int4Linear else torch.ops.kvchat.int8_linear
    assert torch.equal(op(x, codes, scales), apart)
    assert torch.equal(bias, torch.cat([layer.bias for layer in layers]))
    assert torch.equal(torch.cat([run_kernel(layer, x) for layer in layers], dim=1), apart)  # views now
    held = codes.untyped_storage().data_ptr()
    kept = layers[-1].packed if kind is Int4Linear else layers[-1].codes
    assert kept.untyped_storage().data_ptr() == held  # the weights held once


def test_layers_of_different_kinds_or_groups_are_not_fused() -> None:
    linear = torch.nn.Linear(256, 32)
    int4, int8 = Int4Linear.from_linear(linear), Int8Linear.from_linear(linear)
    coarse = Int4Linear.from_linear(linear, group_size=128)
    torch_int4 = Int4Linear.from_linear(linear, "torch")
    plain = make_layer(32, 256)[0]  # bf16 scales and zeros, as a GGUF file's
    assert int4.nested and not plain.nested
    assert fuse_quantized([int4, int8]) is None
    assert fuse_quantized([int4, coarse]) is None
    assert fuse_quantized([int4, plain]) is None
    assert fuse_quantized([int4, torch_int4]) is None
    assert fuse_quantized([torch.nn.Linear(256, 32), int4]) is None
