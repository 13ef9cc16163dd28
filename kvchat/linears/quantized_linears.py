"""Weight-only quantized linear layers, run by kvchat's kernels or torch's (models/quantize.py puts
them in a model).

int8: one symmetric scale per output channel. int4: groups of 32, 64 or 128 inputs with a scale and a
zero each, value = (code - 8) * scale + zero; on kvchat's kernel, groups of 32 quantized here nest their
scales (int4_rounding.NestedScales: 4.5 bits a weight, not 5). On a CPU with AVX-512 VNNI, both run
kvchat's own kernels (`kvchat::int8_linear`, `kvchat::int4_linear`, kvchat/native/quantized_linear.cpp):
the input rounded to int8 per group of 32 twice (the value, then what that leaves, so within 1/65,000
of the group's largest), integer dot products against the codes, each weight byte read once, at about
twice the speed of torch's kernels, which serve other CPUs and CUDA (`_weight_int8pack_mm`,
`_weight_int4pack_mm[_for_cpu]`; int8 on CUDA runs cuBLAS on its codes widened to bf16). Scales, zeros
and torch's kernels' activations are bf16: these run 2-4x slower on fp32 activations, so each layer
casts its input to bf16 and its output back. The packed layout depends on the device and the kernel,
so quantize after the model is on its device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvchat.linears import int4_rounding
from kvchat.linears import weight_layout as layout
from kvchat.linears.int4_rounding import GroupScales, NestedScales
from kvchat.linears.weight_layout import GROUP_SIZE, TILE_ROWS
from kvchat.native import kernels

KERNEL_DTYPE = torch.bfloat16
INT4_GROUP_SIZES = (32, 64, 128)  # the inputs per int4 scale and zero that both kernels take


class Int8Linear(nn.Module):
    """nn.Linear with int8 weights and one bf16 scale per output channel.

    `kernel` says whose kernel runs it, which decides the layout of `codes`: "kvchat" (`layout.tile_int8`)
    or "torch" ((N, K) int8). By default kvchat's where it is built for this device and takes the
    shape, else torch's; asking for kvchat's where it cannot run is an error."""

    codes: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None
    # what describes a layer beside its buffers (`rebuilt`)
    ATTRIBUTES = ("kernel", "in_features", "out_features")
    BUFFERS = ("codes", "scales", "bias")

    def __init__(
        self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, kernel: str | None = None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        if self.in_features % 16:
            # _weight_int8pack_mm reads past the row when K is not a multiple of 16 (a crash, seen).
            raise ValueError(f"int8 needs in_features divisible by 16, got {self.in_features}")
        self.kernel = _choose_kernel(kernel, kernels.int8_linear, codes)
        codes = codes.to(torch.int8)
        self.register_buffer(
            "codes", layout.tile_int8(codes) if self.kernel == "kvchat" else codes.contiguous()
        )
        self.register_buffer("scales", scales.to(KERNEL_DTYPE).contiguous())  # (N,)
        self.register_buffer("bias", None if bias is None else bias.detach().to(KERNEL_DTYPE))

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel: str | None = None) -> Int8Linear:
        weight = _fp32_copy(linear)  # (N, K)
        absmax = weight.abs().amax(dim=1).clamp(min=1e-8)
        scales = (absmax / 127).to(KERNEL_DTYPE)  # the kernel sees the rounded scale: quantize with it
        codes = weight.div_(scales.float()[:, None]).round_().clamp_(-128, 127)
        return cls(codes, scales, linear.bias, kernel)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the kernel multiplies by, in fp32: (N, K)."""
        codes = layout.untile_int8(self.codes) if self.kernel == "kvchat" else self.codes
        return codes.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (M, K)
        if self.kernel == "kvchat":
            out = _kernel(kernels.int8_linear)(flat, self.codes, self.scales)  # (M, N)
        elif flat.device.type == "cuda":
            # torch's int8 kernel on CUDA took 300 us for one row of a 2048x11008 weight and 99 ms for
            # 2,000 (H100); cuBLAS on the codes widened to bf16, then the rows' scales, 87 and 190 us.
            out = nn.functional.linear(flat.to(KERNEL_DTYPE), self.codes.to(KERNEL_DTYPE)) * self.scales
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat.to(KERNEL_DTYPE), self.codes, self.scales)
        return _finish(out, self.bias, x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel, "
            f"{self.kernel}'s kernel"
        )


class Int4Linear(nn.Module):
    """nn.Linear with 4-bit codes in groups of 32, 64 or 128 inputs (`group_size`, from the shape of the
    scales: (N, K / group_size)), each group with a bf16 scale and zero, or nested scales (groups of 32,
    kvchat's kernel only).

    `kernel` says whose kernel runs it, which decides the layout of `packed` and `params`: "kvchat"
    (`layout.tile_int4`, `layout.tile_params`) or "torch" (`layout.pack_int4`), chosen as for
    Int8Linear."""

    packed: torch.Tensor
    params: torch.Tensor
    bias: torch.Tensor | None
    ATTRIBUTES = ("kernel", "in_features", "out_features", "group_size", "nested")
    BUFFERS = ("packed", "params", "bias")

    def __init__(
        self,
        codes: torch.Tensor,
        scales: GroupScales | NestedScales,
        bias: torch.Tensor | None,
        kernel: str | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape  # codes: (N, K) in 0..15
        self.nested = isinstance(scales, NestedScales)
        if isinstance(scales, GroupScales):
            scales = GroupScales(scales.scales.to(KERNEL_DTYPE), scales.zeros.to(KERNEL_DTYPE))
        per_group = scales.scale_codes if isinstance(scales, NestedScales) else scales.scales
        self.group_size = self.in_features // max(per_group.shape[1], 1)
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 groups are of {', '.join(map(str, INT4_GROUP_SIZES))} inputs")
        if self.nested and self.group_size != GROUP_SIZE:
            raise ValueError(f"nested int4 scales are for groups of {GROUP_SIZE} inputs")
        if self.in_features % self.group_size or self.out_features % 16:
            raise ValueError(
                f"int4 needs in_features divisible by {self.group_size} and out_features by 16, "
                f"got {self.in_features} and {self.out_features}"
            )
        assert per_group.shape == (self.out_features, self.in_features // self.group_size)
        self.kernel = _choose_kernel(kernel, kernels.int4_linear, codes)
        if self.kernel == "kvchat":
            self.register_buffer("packed", layout.tile_int4(codes))
            self.register_buffer("params", layout.tile_params(scales))
        elif isinstance(scales, NestedScales):
            raise ValueError("nested int4 scales run on kvchat's kernel only")
        else:
            pairs = torch.stack([scales.scales, scales.zeros], dim=-1)  # (N, K/G, 2)
            self.register_buffer("packed", layout.pack_int4(codes))
            self.register_buffer("params", pairs.transpose(0, 1).contiguous())  # (K/G, N, 2)
        self.register_buffer("bias", None if bias is None else bias.detach().to(KERNEL_DTYPE))

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, kernel: str | None = None, group_size: int = GROUP_SIZE
    ) -> Int4Linear:
        """Groups of 32 on kvchat's kernel nest their scales; others take a bf16 scale and zero each."""
        out_features, in_features = linear.weight.shape
        if group_size not in INT4_GROUP_SIZES or in_features % group_size:
            raise ValueError(f"int4 needs in_features divisible by {group_size}, got {in_features}")
        kernel = _choose_kernel(kernel, kernels.int4_linear, linear.weight)
        groups = _fp32_copy(linear).reshape(out_features, -1, group_size)  # (N, K/G, G)
        codes, scales = int4_rounding.round_groups(groups, kernel == "kvchat" and group_size == GROUP_SIZE)
        return cls(codes.reshape(out_features, in_features), scales, linear.bias, kernel)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the kernel multiplies by, in fp32: (N, K). torch's layout is read by running its
        kernel on an identity."""
        if self.kernel == "kvchat":
            return layout.untile_int4(self.packed, self.params)
        eye = torch.eye(self.in_features, dtype=KERNEL_DTYPE, device=self.packed.device)  # (K, K)
        return _int4_mm(eye, self.packed, self.group_size, self.params).float().T.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (M, K)
        if self.kernel == "kvchat":
            out = _kernel(kernels.int4_linear)(flat, self.packed, self.params)  # (M, N)
        else:
            out = _int4_mm(flat.to(KERNEL_DTYPE), self.packed, self.group_size, self.params)
        return _finish(out, self.bias, x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 group {self.group_size}{', nested scales' if self.nested else ''}, {self.kernel}'s kernel"
        )


def rebuilt(
    kind: type[Int4Linear | Int8Linear], attributes: dict[str, object], buffers: dict[str, torch.Tensor]
) -> Int4Linear | Int8Linear:
    """A layer of `kind` from another one's `ATTRIBUTES` and `BUFFERS` (a missing bias: none), as
    models/quantized_cache.py keeps them: its buffers as they are, laid out for its kernel."""
    layer = kind.__new__(kind)
    nn.Module.__init__(layer)
    for name in kind.ATTRIBUTES:
        setattr(layer, name, attributes[name])
    for name in kind.BUFFERS:
        layer.register_buffer(name, buffers.get(name))
    return layer


def fuse_quantized(linears: list[nn.Module]) -> list[torch.Tensor | None] | None:
    """One projection for several int4 (or int8) layers on kvchat's kernels that read the same input:
    (codes, scales, bias) as the kernel takes them, its outputs theirs side by side; None unless all
    are alike (kind, inputs, int4 group and scales, bias or none). Each layer keeps views of the fused
    tensors in place of its own, so the weights are held once. The kernels compute each tile of 16 rows
    alone, so the fused outputs are the layers' own, bit for bit."""
    first = linears[0]
    kind = type(first)
    if kind not in (Int4Linear, Int8Linear) or any(
        type(m) is not kind
        or m.kernel != "kvchat"
        or m.in_features != first.in_features
        or getattr(m, "group_size", None) != getattr(first, "group_size", None)
        or getattr(m, "nested", None) != getattr(first, "nested", None)
        or (m.bias is None) != (first.bias is None)
        for m in linears
    ):
        return None
    names = ("packed", "params") if kind is Int4Linear else ("codes", "scales")
    fused: list[torch.Tensor | None] = []
    for name in names:
        whole = torch.cat([m.get_buffer(name) for m in linears])
        at = 0
        for m in linears:
            count = m.get_buffer(name).shape[0]
            setattr(m, name, whole[at : at + count])  # a view: the weights are held once
            at += count
        fused.append(whole)
    fused.append(None if first.bias is None else torch.cat([m.get_buffer("bias") for m in linears]))
    return fused


def _choose_kernel(asked: str | None, ours: Callable[[], Callable | None], codes: torch.Tensor) -> str:
    """kvchat's kernel where `ours()` is built, the device is a CPU and the shape fits its tiles (16
    rows by 32 inputs); else torch's. Asking for kvchat's where it cannot run raises ValueError."""
    rows, inputs = codes.shape
    fits = codes.device.type == "cpu" and rows % TILE_ROWS == 0 and inputs % GROUP_SIZE == 0
    if asked not in (None, "kvchat", "torch"):
        raise ValueError(f"kernel must be kvchat or torch, got {asked!r}")
    if asked == "kvchat" and not (fits and ours() is not None):
        why = (
            kernels.build_error() or "no AVX-512 VNNI"
            if fits
            else f"a {rows}x{inputs} weight on {codes.device}"
        )
        raise ValueError(f"kvchat's kernel cannot run this layer here ({why})")
    return asked or ("kvchat" if fits and ours() is not None else "torch")


def _fp32_copy(linear: nn.Linear) -> torch.Tensor:
    # A copy even of an fp32 weight: quantizing works in place on it, and one (N, K) temporary is
    # what a 3B model's output layer can afford (1.2 GB).
    return linear.weight.detach().to(torch.float32, copy=True)


def _finish(out: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)


def _int4_mm(
    x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)


def _kernel(find: Callable[[], Callable | None]) -> Callable:
    op = find()
    assert op is not None, "a layer takes kvchat's kernel where it is built (_choose_kernel)"
    return op
