"""kvchat's fp32 kernel (`kvchat::fp32_linear`, through `TiledLinear`) against the float64 product of
the same values, and one order of sums for any number of rows."""

import pytest
import torch
from torch import nn

from kvchat.linears.bf16_linears import TiledLinear, fuse_tiled
from kvchat.linears.weight_layout import tile_fp32, untile_fp32
from kvchat.native import kernels
from kvchat.native.kernels import has_cpp_compiler

pytestmark = pytest.mark.skipif(
    not has_cpp_compiler() or kernels.tier() == "portable",
    reason="the kernel is built with a C++ compiler, for every tier but the portable one",
)


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert kernels.fp32_linear() is not None, kernels.build_error()


def make_linear(out_features: int, in_features: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 70])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [80, 240])  # one row streams 8 tiles, several rows 4
def test_the_layer_equals_the_exact_product_within_fp32s_sums(rows, bias, out_features) -> None:
    linear = make_linear(out_features, 104, bias)
    x = torch.randn(1, rows, 104)
    got = TiledLinear.of(linear)(x)
    assert got.shape == (1, rows, out_features) and got.dtype == torch.float32
    exact = x.double() @ linear.weight.double().T
    if bias:
        exact = exact + linear.bias.double()
    bound = 2.0**-21 * (x.double().abs() @ linear.weight.double().abs().T + exact.abs() + 1)
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("bias", [False, True])
def test_a_rows_outputs_are_the_same_bits_alone_and_among_others(bias: bool) -> None:
    layer = TiledLinear.of(make_linear(272, 96, bias))  # 17 tiles: 4 at a time, then one
    x, residual = torch.randn(75, 96), torch.randn(75, 272)  # 64 rows a group, then 4, 4, 2 and 1
    together = torch.ops.kvchat.fp32_linear(x, layer.tiles, layer.bias, residual)
    for i in range(75):
        alone = torch.ops.kvchat.fp32_linear(x[i : i + 1], layer.tiles, layer.bias, residual[i : i + 1])
        assert torch.equal(alone[0], together[i])


def test_a_residual_is_added_to_the_output() -> None:
    layer = TiledLinear.of(make_linear(48, 32, bias=True))
    x, residual = torch.randn(6, 32), torch.randn(6, 48)
    added = torch.ops.kvchat.fp32_linear(x, layer.tiles, layer.bias, residual)
    assert torch.equal(added, residual + layer(x))


@pytest.mark.parametrize("rows", [1, 9])
def test_threads_split_the_tiles_without_changing_a_bit(on_one_then_two_threads, rows: int) -> None:
    layer = TiledLinear.of(make_linear(400, 128, bias=True))
    x = torch.randn(rows, 128)
    one, two = on_one_then_two_threads(lambda: layer(x))
    assert torch.equal(one, two)


def test_fused_layers_give_their_members_outputs_side_by_side() -> None:
    members = [TiledLinear.of(make_linear(n, 64, bias=True, seed=n)) for n in (96, 32, 48)]
    x = torch.randn(3, 64)
    alone = [m(x) for m in members]
    fused = fuse_tiled(members)
    assert fused is not None and fused.in_features == 64 and fused.out_features == 176
    assert torch.equal(fused(x), torch.cat(alone, dim=-1))


def test_the_tiles_hold_the_weight() -> None:
    weight = torch.randn(48, 20)
    tiles = tile_fp32(weight)
    assert tiles.shape == (3, 20, 16)
    assert torch.equal(tiles[1, 4, 5], weight[16 + 5, 4])  # tile 1, input 4, row 5
    assert torch.equal(untile_fp32(tiles), weight)


def test_the_kernel_refuses_mismatched_shapes() -> None:
    tiles = tile_fp32(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="fp32_linear"):
        torch.ops.kvchat.fp32_linear(torch.randn(2, 48), tiles, None)
    with pytest.raises(RuntimeError, match="fp32_linear"):
        torch.ops.kvchat.fp32_linear(torch.randn(2, 64), tiles, torch.zeros(16))
    with pytest.raises(RuntimeError, match="fp32_linear"):
        torch.ops.kvchat.fp32_linear(torch.randn(2, 64, dtype=torch.bfloat16), tiles, None)
