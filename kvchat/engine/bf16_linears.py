"""bf16 linear layers made for decoding on CPU, replacing a model's nn.Linear layers in place.

The lean decode step's bf16 linear layers, and the module forward's, are replaced in place
(`tile_linears_`, `pack_linears_`) by ones made for decoding. A decode token reads every weight once,
so its linears' pace is the rate they read weights at. On these CPUs torch's bf16 `F.linear` of one
row reads 5-11 GB/s; oneDNN's kernel on a weight reordered once for it (`PackedLinear`) 6-17 GB/s;
kvchat's kernel (`TiledLinear`, native/bf16_linear.cpp) on its tiles of 16 rows streams a SmolLM2
token's weights at 21-24 GB/s, and is as fast as oneDNN's GEMM on a 512-token prefill (on CPUs with
AMX, where it runs several rows on the tile unit, faster), so it serves every row count. oneDNN's
serves CPUs without AVX-512 BF16.
Either keeps its weight out of the module's parameters (the packed one is an opaque tensor; the tiles
are a buffer): a tied output layer keeps the embedding's tensor and gets its own copy.

A decoder layer's projections that read the same input (query, key and value; gate and up) are also
fused into one tiled weight (`fuse_tiled`) for the lean step's decoder_layers, one kernel call where
there were two or three; the layers keep views of its tiles, so the weights are held once.
"""

from __future__ import annotations

import torch
from torch import nn

from kvchat.models import weight_layout as layout
from kvchat.models.weight_layout import TILE_ROWS
from kvchat.native import kernels


def is_cpu_bf16(module: nn.Module) -> bool:
    """An exact nn.Linear with bf16 weights on a CPU."""
    weight = module.weight if type(module) is nn.Linear else None
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"


def can_tile(module: nn.Module) -> bool:
    """A CPU bf16 linear of a shape kvchat's kernel takes (rows in tiles of 16, inputs in pairs), where
    the kernel is built (AVX-512 BF16)."""
    if not (is_cpu_bf16(module) and isinstance(module, nn.Linear)):
        return False
    fits = module.out_features % TILE_ROWS == 0 and module.in_features % 2 == 0
    return fits and kernels.bf16_linear() is not None


def can_pack(module: nn.Module) -> bool:
    """A CPU bf16 linear, where this torch has oneDNN's packed linear kernels."""
    return (
        is_cpu_bf16(module)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class TiledLinear(nn.Module):
    """The drop-in replacement of a bf16 nn.Linear that runs kvchat's kernel over its weight's tiles."""

    tiles: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, tiles: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = tiles.shape[1] * 2, tiles.shape[0] * TILE_ROWS
        self.register_buffer("tiles", tiles)  # (out/16, in/2, 32)
        self.register_buffer("bias", bias)

    @classmethod
    def of(cls, linear: nn.Linear) -> TiledLinear:
        """The tiled layer of `linear`."""
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(layout.tile_bf16(linear.weight.detach()), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (N, in)
        out = torch.ops.kvchat.bf16_linear(rows, self.tiles, self.bias)  # (N, out)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16, kvchat's kernel"


class PackedLinear(nn.Module):
    """The drop-in replacement of a bf16 nn.Linear that runs oneDNN's kernel over its packed weight."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()  # (out, in)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # opaque, not a parameter
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (N, in)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")  # (N, out)
        return out.view(*x.shape[:-1], self.out_features)


def fuse_tiled(linears: list[nn.Module]) -> TiledLinear | None:
    """One tiled layer for several that read the same input, its outputs theirs side by side, or None
    unless all are tiled, alike in their inputs and bias. Each keeps a view of the fused tiles in place
    of its own."""
    tiled = [m for m in linears if isinstance(m, TiledLinear)]
    if len(tiled) != len(linears):
        return None
    first = tiled[0]
    if any(m.in_features != first.in_features or (m.bias is None) != (first.bias is None) for m in tiled):
        return None
    biases = None if first.bias is None else torch.cat([m.bias for m in tiled if m.bias is not None])
    fused = TiledLinear(torch.cat([m.tiles for m in tiled]), biases)
    at = 0
    for m in tiled:
        count = m.tiles.shape[0]
        m.tiles = fused.tiles[at : at + count]  # a view: the weights are held once
        at += count
    return fused


def tile_linears_(model: nn.Module) -> int:
    """Replace every linear of `model` that `can_tile` in place; returns how many were replaced."""
    return _replace(model, can_tile, TiledLinear.of)


def pack_linears_(model: nn.Module) -> int:
    """Replace every linear of `model` that `can_pack` in place; returns how many were replaced."""
    return _replace(model, can_pack, PackedLinear)


def _replace(model: nn.Module, wanted, replacement) -> int:
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and wanted(child)
    ]
    for parent, name, child in targets:
        setattr(parent, name, replacement(child))
    return len(targets)
