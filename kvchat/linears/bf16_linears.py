"""bf16 and fp32 linear layers made for decoding on CPU, replacing a model's nn.Linear layers in place.

The lean decode step's bf16 and fp32 linear layers, and the module forward's, are replaced in place
(`tile_linears_`, `pack_linears_`) by ones made for decoding. A decode token reads every weight once,
so its linears' pace is the rate they read weights at. On these CPUs torch's bf16 `F.linear` of one
row reads 5-11 GB/s; oneDNN's kernel on a weight reordered once for it (`PackedLinear`) 6-17 GB/s;
kvchat's kernel (`TiledLinear`, native/bf16_linear.cpp) on its tiles of 16 rows streams a SmolLM2
token's weights at 21-24 GB/s, and is as fast as oneDNN's GEMM on a 512-token prefill (on CPUs with
AMX, where it runs several rows on the tile unit with batch invariance off, faster), so it serves every
row count. Where it is not built, oneDNN's serves CPUs whose oneDNN takes bf16 (AVX-512 or AVX-NE-CONVERT),
and `UpcastLinear` every other CPU (AVX2-only x86, Arm64 without oneDNN's bf16): torch's bf16 product
of one row there reads 6-7 GB/s but of 128 rows 0.1 GB/s, so from 4 rows it widens the weight to fp32 a
block at a time (docs/cpu-tiers.md has the figures). In fp32, TiledLinear runs native/fp32_linear.cpp:
MKL's products of one row and of several sum in different orders, so a row's outputs depended on the
rows computed with it; kvchat's sums each output in one order for any number of rows, reads one row's
weights 1.2-3.5x faster than MKL here and many rows about as fast.
Either keeps its weight out of the module's parameters (the packed one is an opaque tensor; the tiles
are a buffer): a tied output layer keeps the embedding's tensor and gets its own copy.

A decoder layer's projections that read the same input (query, key and value; gate and up) are also
fused into one tiled weight (`fuse_tiled`) for the lean step's decoder_layers, one kernel call where
there were two or three; the layers keep views of its tiles, so the weights are held once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from kvchat.linears import weight_layout as layout
from kvchat.linears.weight_layout import TILE_ROWS
from kvchat.native import kernels

# kvchat's kernel for a tiled weight of each dtype, and the layout it reads (linears/weight_layout.py)
KERNELS = {torch.bfloat16: kernels.bf16_linear, torch.float32: kernels.fp32_linear}
LAYOUTS = {torch.bfloat16: layout.tile_bf16, torch.float32: layout.tile_fp32}
UPCAST_ROWS = 4  # from here UpcastLinear's fp32 product beats torch's bf16 one (AVX2, one thread)
UPCAST_BLOCK_BYTES = 1 << 20  # one block of the widened weight, to stay in a core's L2


def is_cpu_bf16(module: nn.Module) -> bool:
    """An exact nn.Linear with bf16 weights on a CPU."""
    return _cpu_weight_dtype(module) == torch.bfloat16


def _cpu_weight_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype of an exact nn.Linear's weight on a CPU, else None."""
    weight = module.weight if type(module) is nn.Linear else None
    return weight.dtype if isinstance(weight, torch.Tensor) and weight.device.type == "cpu" else None


def can_tile(module: nn.Module) -> bool:
    """A CPU bf16 or fp32 linear of a shape kvchat's kernel takes (rows in tiles of 16; bf16 inputs in
    pairs), where the kernel is built (AVX-512 BF16 for bf16, AVX-512 for fp32)."""
    dtype = _cpu_weight_dtype(module)
    if dtype not in KERNELS or not isinstance(module, nn.Linear) or module.out_features % TILE_ROWS:
        return False
    return (dtype != torch.bfloat16 or module.in_features % 2 == 0) and KERNELS[dtype]() is not None


def can_pack(module: nn.Module) -> bool:
    """A CPU bf16 linear, where this torch's oneDNN packs bf16 weights on this CPU."""
    return is_cpu_bf16(module) and onednn_packs_bf16()


@functools.cache
def onednn_packs_bf16() -> bool:
    """Whether oneDNN's packed bf16 linear runs on this CPU: it asks for AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT and raises elsewhere, so a small weight is packed once to find out."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


def fallback_kind(onednn_bf16: bool) -> type[nn.Module]:
    """The layer for a CPU bf16 linear that kvchat's kernel does not run: oneDNN's packed one where it
    takes bf16 on this CPU (`onednn_packs_bf16`), else UpcastLinear."""
    return PackedLinear if onednn_bf16 else UpcastLinear


class TiledLinear(nn.Module):
    """The drop-in replacement of a bf16 or fp32 nn.Linear that runs kvchat's kernel over its weight's
    tiles."""

    tiles: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, tiles: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        per_operand = 2 if tiles.dtype == torch.bfloat16 else 1  # inputs an operand of the tiles holds
        self.in_features, self.out_features = tiles.shape[1] * per_operand, tiles.shape[0] * TILE_ROWS
        self.register_buffer("tiles", tiles)  # bf16 (out/16, in/2, 32), fp32 (out/16, in, 16)
        self.register_buffer("bias", bias)

    @classmethod
    def of(cls, linear: nn.Linear) -> TiledLinear:
        """The tiled layer of `linear`."""
        bias = None if linear.bias is None else linear.bias.detach()
        weight = linear.weight.detach()
        return cls(LAYOUTS[weight.dtype](weight), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.tiles.dtype)  # (N, in)
        out = _kernel(self.tiles.dtype)(rows, self.tiles, self.bias)  # (N, out)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        dtype = "bf16" if self.tiles.dtype == torch.bfloat16 else "fp32"
        return f"in_features={self.in_features}, out_features={self.out_features}, {dtype}, kvchat's kernel"


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


class UpcastLinear(nn.Linear):
    """A bf16 nn.Linear for CPUs where neither kvchat's kernel nor oneDNN's runs: up to UPCAST_ROWS - 1
    rows by torch's bf16 product, which reads the weight as stored; more in fp32, the weight widened
    UPCAST_BLOCK_BYTES at a time so each block is read from the cache (fp32 sums, rounded to bf16 once,
    as torch's bf16 product rounds)."""

    @classmethod
    def of(cls, linear: nn.Linear) -> UpcastLinear:
        """`linear` as an UpcastLinear, holding the same weight and bias (a tied weight stays tied)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (N, in)
        if rows.shape[0] < UPCAST_ROWS or rows.device.type != "cpu":
            return super().forward(x)
        wide = rows.detach().float().t()  # (in, N)
        out = torch.empty(self.out_features, rows.shape[0])  # (out, N) fp32
        step = max(TILE_ROWS, UPCAST_BLOCK_BYTES // (4 * self.in_features))
        for start in range(0, self.out_features, step):
            block = self.weight.detach()[start : start + step].float()  # (step, in)
            torch.mm(block, wide, out=out[start : start + step])
        if self.bias is not None:
            out += self.bias.detach().float()[:, None]
        return out.to(x.dtype).t().reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16, widened to fp32"


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


def serve_bf16_linears_(model: nn.Module) -> int:
    """Replace every CPU bf16 nn.Linear of `model` left (not tiled) by the `fallback_kind` of this CPU,
    in place; returns how many were replaced."""
    kind = fallback_kind(onednn_packs_bf16())
    return _replace(model, is_cpu_bf16, PackedLinear if kind is PackedLinear else UpcastLinear.of)


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


def _kernel(dtype: torch.dtype) -> Callable:
    op = KERNELS[dtype]()
    assert op is not None, "a TiledLinear is made where its kernel is built (can_tile)"
    return op
