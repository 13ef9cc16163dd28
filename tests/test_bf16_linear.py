"""kvchat's bf16 kernel (`kvchat::bf16_linear`, through `TiledLinear`) against the float64 product of
the same bf16 values, rounded once to bf16, and the layers `tile_linears_` replaces."""

import pytest
import torch
from torch import nn

from kvchat.linears.bf16_linears import TiledLinear, can_tile, fuse_tiled, tile_linears_
from kvchat.linears.weight_layout import tile_bf16, untile_bf16
from kvchat.native import kernels
from kvchat.native.kernels import has_cpp_compiler

pytestmark = pytest.mark.skipif(
    not has_cpp_compiler() or kernels.tier() == "portable",
    reason="the kernel is built with a C++ compiler, for every tier but the portable one",
)


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert kernels.bf16_linear() is not None, kernels.build_error()


def make_linear(out_features: int, in_features: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16)


def exact(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x @ W.T + b in float64 over the bf16 values: what the kernel rounds once."""
    out = x.double() @ linear.weight.double().T
    return out if linear.bias is None else out + linear.bias.double()


def rounding_bound(linear: nn.Linear, x: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Half a bf16 step of the exact result (the one rounding), plus what fp32's sums may lose."""
    half_step = want.abs().clamp(min=2.0**-126) * 2.0**-8
    return half_step + 2.0**-20 * (x.double().abs() @ linear.weight.double().abs().T)


# Several rows run on AMX where the CPU has it, in blocks of 16 rows (the last padded) by 2 tiles, when
# the inputs come in whole steps of 32 (96; 104 does not: the AVX-512 loop takes it).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 32, 70])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [80, 240])  # one row streams 8 tiles, then 4, 2, 1
@pytest.mark.parametrize("in_features", [96, 104])
def test_the_layer_equals_the_exact_product_rounded_once(
    rows: int, bias: bool, out_features: int, in_features: int
) -> None:
    linear = make_linear(out_features, in_features, bias)
    x = torch.randn(1, rows, in_features, dtype=torch.bfloat16)
    got = TiledLinear.of(linear)(x)
    assert got.shape == (1, rows, out_features) and got.dtype == torch.bfloat16
    want = exact(linear, x)
    assert ((got.double() - want).abs() <= rounding_bound(linear, x, want)).all()
    # fp32's sums change the rounding of an entry only where the exact value is next to a tie
    assert (got == want.to(torch.bfloat16)).float().mean() > 0.99


def test_input_pairs_past_the_last_four_are_summed_too() -> None:
    """44 inputs: 22 pairs, the kernel's steps of 4 pairs leave 2 for its tail."""
    linear = make_linear(32, 44, bias=False)
    x = torch.zeros(1, 44, dtype=torch.bfloat16)
    x[0, -1] = 1.0  # only the last input counts
    got = TiledLinear.of(linear)(x)
    assert torch.equal(got[0], linear.weight[:, -1])


def test_a_float32_input_is_taken_as_bf16() -> None:
    linear = make_linear(32, 64, bias=True)
    x = torch.randn(3, 64)
    layer = TiledLinear.of(linear)
    assert torch.equal(layer(x), layer(x.to(torch.bfloat16)))


@pytest.mark.parametrize("rows", [1, 9])
def test_threads_split_the_tiles_without_changing_a_bit(on_one_then_two_threads, rows: int) -> None:
    layer = TiledLinear.of(make_linear(400, 128, bias=True))
    x = torch.randn(rows, 128, dtype=torch.bfloat16)
    one, two = on_one_then_two_threads(lambda: layer(x))
    assert torch.equal(one, two)


@pytest.mark.parametrize("rows", [1, 6, 40])
def test_a_residual_is_added_to_the_rounded_output_as_bf16_adds(rows: int) -> None:
    layer = TiledLinear.of(make_linear(208, 64, bias=True))
    x, residual = (
        torch.randn(rows, 64, dtype=torch.bfloat16),
        torch.randn(rows, 208, dtype=torch.bfloat16) * 4,
    )
    added = torch.ops.kvchat.bf16_linear(x, layer.tiles, layer.bias, residual)
    assert torch.equal(added, residual + layer(x))


def test_fused_layers_give_their_members_outputs_side_by_side() -> None:
    members = [TiledLinear.of(make_linear(n, 64, bias=True, seed=n)) for n in (96, 32, 48)]
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    alone = [m(x) for m in members]
    fused = fuse_tiled(members)
    assert fused is not None and fused.out_features == 176
    assert torch.equal(fused(x), torch.cat(alone, dim=-1))
    # the members now read views of the fused tiles: the same outputs, the weights held once
    assert all(torch.equal(m(x), want) for m, want in zip(members, alone, strict=True))
    assert all(
        m.tiles.untyped_storage().data_ptr() == fused.tiles.untyped_storage().data_ptr() for m in members
    )


def test_only_alike_tiled_layers_are_fused() -> None:
    with_bias, without = TiledLinear.of(make_linear(32, 64, True)), TiledLinear.of(make_linear(32, 64, False))
    assert fuse_tiled([with_bias, without]) is None
    assert fuse_tiled([without, TiledLinear.of(make_linear(32, 96, False))]) is None
    assert fuse_tiled([without, make_linear(32, 64, False)]) is None


def test_the_tiles_hold_the_weight() -> None:
    weight = torch.randn(48, 20, dtype=torch.bfloat16)
    tiles = tile_bf16(weight)
    assert tiles.shape == (3, 10, 32)
    assert torch.equal(tiles[1, 4, 2 * 5 : 2 * 5 + 2], weight[16 + 5, 8:10])  # tile 1, pair 4, row 5
    assert torch.equal(untile_bf16(tiles), weight)


def test_the_kernel_refuses_mismatched_shapes() -> None:
    tiles = tile_bf16(torch.randn(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16_linear"):
        torch.ops.kvchat.bf16_linear(torch.randn(2, 48, dtype=torch.bfloat16), tiles, None)
    with pytest.raises(RuntimeError, match="bf16_linear"):
        torch.ops.kvchat.bf16_linear(torch.randn(2, 64, dtype=torch.bfloat16), tiles, torch.zeros(16))
    with pytest.raises(RuntimeError, match="bf16_linear"):
        torch.ops.kvchat.bf16_linear(torch.randn(2, 64), tiles, None)


def test_only_cpu_bf16_and_fp32_linears_of_whole_tiles_are_replaced() -> None:
    model = nn.Sequential(
        nn.Linear(8, 16),  # fp32: kvchat's fp32 kernel
        nn.Linear(8, 16, dtype=torch.bfloat16),
        nn.Linear(8, 12, dtype=torch.bfloat16),  # 12 rows: no whole tile
        nn.Linear(7, 16, dtype=torch.bfloat16),  # 7 inputs: not in pairs
        nn.Linear(8, 16, dtype=torch.float16),
        nn.Embedding(4, 8, dtype=torch.bfloat16),
    )
    assert [can_tile(m) for m in model] == [True, True, False, False, False, False]
    assert tile_linears_(model) == 2
    kinds = [TiledLinear, TiledLinear, nn.Linear, nn.Linear, nn.Linear, nn.Embedding]
    assert [type(m) for m in model] == kinds
    assert model[0].tiles.dtype == torch.float32 and model[1].tiles.dtype == torch.bfloat16


@pytest.mark.parametrize("bias", [False, True])
def test_a_rows_outputs_are_the_same_bits_alone_and_among_others(bias: bool) -> None:
    """Several rows run the one-row kernel's order of sums: a row's outputs never depend on the rows
    computed with it (decode against a prefill chunk or speculation's drafts)."""
    layer = TiledLinear.of(make_linear(272, 96, bias))  # 17 tiles: 8 rows by 2 tiles, then one tile
    x = torch.randn(75, 96, dtype=torch.bfloat16)  # 64 rows a group, then 8, 2 and 1 at a time
    residual = torch.randn(75, 272, dtype=torch.bfloat16)
    together = torch.ops.kvchat.bf16_linear(x, layer.tiles, layer.bias, residual)
    for i in range(75):
        alone = torch.ops.kvchat.bf16_linear(x[i : i + 1], layer.tiles, layer.bias, residual[i : i + 1])
        assert torch.equal(alone[0], together[i])
    for first, count in ((3, 5), (10, 7), (0, 16)):  # speculation-sized blocks
        rows = slice(first, first + count)
        block = torch.ops.kvchat.bf16_linear(x[rows], layer.tiles, layer.bias, residual[rows])
        assert torch.equal(block, together[rows])
