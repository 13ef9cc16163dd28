"""Decoding on CPU through the model's own modules: the lean decode step and its bf16 linear layers.

The lean step runs one token, or speculation's few, through a layer loop over the model's modules,
without the module forward's cache and mask bookkeeping. For a 135M model the weights take ~20 ms a
token to read where the module forward took ~60; the rest was per-op overhead and bf16 SDPA. The loop
calls the model's own modules (projections, MLP, rotary embedding), so replaced linear layers
(quantized ones) run unchanged; the RMSNorms and the rotation are the same arithmetic in fewer ops.
Only families whose decoder layer it reproduces exactly take it (Llama, Qwen2, Qwen3, full
attention); others keep the module forward.

Its bf16 linear layers, and the module forward's, are replaced in place (`tile_linears_`,
`pack_linears_`) by ones made for decoding. A decode token reads every weight once, so its linears'
pace is the rate they read weights at. On these CPUs torch's bf16 `F.linear` of one row reads 5-11
GB/s; oneDNN's kernel on a weight reordered once for it (`PackedLinear`) 6-17 GB/s; kvchat's kernel
(`TiledLinear`, native/bf16_linear.cpp) on its tiles of 16 rows 20-28 GB/s, and as fast as oneDNN's
GEMM on a 512-token prefill, so it serves every row count. oneDNN's serves CPUs without AVX-512 BF16.
Either keeps its weight out of the module's parameters (the packed one is an opaque tensor; the tiles
are a buffer; under `--compile` a tiled layer keeps its weight too, for the graph): a tied output
layer keeps the embedding's tensor and gets its own copy.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvchat.models import weight_layout as layout
from kvchat.models.weight_layout import TILE_ROWS
from kvchat.native import kernels

FAMILIES = frozenset({"llama", "qwen2", "qwen3"})
RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})  # weight * normalized x
MAX_LEAN_TOKENS = 16  # beyond speculation's drafts a forward is a prefill, where SDPA is the better kernel


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

    def __init__(self, linear: nn.Linear, keep_weight: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("tiles", layout.tile_bf16(linear.weight.detach()))  # (out/16, in/2, 32)
        self.weight = linear.weight if keep_weight else None
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and self.weight is not None:
            # In the compiled graph inductor packs the weight for its own GEMV, faster there than
            # this kernel's calls.
            return F.linear(x, self.weight, self.bias)
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


def tile_linears_(model: nn.Module, keep_weights: bool = False) -> int:
    """Replace every linear of `model` that `can_tile` in place; returns how many were replaced. With
    `keep_weights` each keeps its weight too, for a compiled graph (compiled_step.py)."""
    return _replace(model, can_tile, lambda linear: TiledLinear(linear, keep_weights))


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


class KVStore(Protocol):
    def attend(
        self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Keep one layer's new K/V (1, Hk, q, D); return the causal attention of the queries
        (1, Hq, q, D) over all of its K/V so far, (1, q, Hq * D)."""
        ...


class LeanDecodeStep:
    """Runs `num_new` <= MAX_LEAN_TOKENS tokens of a Llama-like model over the K/V a `KVStore` holds."""

    def __init__(self, model):
        self.base = model.model
        self.lm_head = model.lm_head
        first = self.base.layers[0].self_attn
        self.head_dim, self.scaling = first.head_dim, first.scaling
        self.has_qk_norm = hasattr(first, "q_norm")

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv: KVStore, num_logits: int
    ) -> torch.Tensor:
        """Logits of the last `num_logits` of the tokens (num_logits, V). input_ids, position_ids (1, q)."""
        hidden = self.base.embed_tokens(input_ids)  # (1, q, d)
        cos, sin = rotation(self.base, hidden, position_ids)  # (1, 1, q, D) each
        for index, layer in enumerate(self.base.layers):
            attn = layer.self_attn
            x = rms_norm(layer.input_layernorm, hidden)  # (1, q, d)
            query, keys, values = self._project(attn, x)
            query, keys = rope(query, cos, sin), rope(keys, cos, sin)
            out = kv.attend(index, query, keys, values, self.scaling)  # (1, q, Hq*D)
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + layer.mlp(rms_norm(layer.post_attention_layernorm, hidden))
        hidden = rms_norm(self.base.norm, hidden[:, -num_logits:])  # (1, n, d)
        return self.lm_head(hidden)[0]  # (n, V)

    def _project(self, attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query (1, Hq, q, D), keys and values (1, Hk, q, D) before RoPE."""
        shape = (*x.shape[:-1], -1, self.head_dim)  # (1, q, H, D)
        query, keys = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
        if self.has_qk_norm:
            query, keys = rms_norm(attn.q_norm, query), rms_norm(attn.k_norm, keys)
        values = attn.v_proj(x).view(shape)
        return query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """The families' RMSNorm module applied to `x`, with torch's fused kernel for its middle: in fp32,
    x / sqrt(mean(x^2) + eps), cast back, times the weight (4 ops where the module runs 8)."""
    if type(norm).__name__ not in RMS_NORMS:
        return norm(x)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, norm.variance_epsilon)
    return norm.weight * normed.to(x.dtype)


def rotation(base, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope`'s cos and signed sin, (1, 1, q, D) each, from the model's rotary embedding."""
    cos, sin = base.rotary_emb(hidden, position_ids)  # (1, q, D) each
    half = sin.shape[-1] // 2
    return cos.unsqueeze(1), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(1)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """The families' rotary embedding, x * cos + rotate_half(x) * sin, with rotate_half(x) * sin computed
    as the halves swapped times sin with its first half negated: the same products, one roll where
    rotate_half slices twice, negates and concatenates. x (1, H, q, D); cos, signed_sin (1, 1, q, D)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def make_decode_step(model) -> LeanDecodeStep | None:
    """The lean step for a model it reproduces exactly, else None (the module forward runs)."""
    if getattr(model.config, "model_type", None) not in FAMILIES:
        return None
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not hasattr(model, "lm_head") or not hasattr(base, "rotary_emb"):
        return None
    for layer in layers:
        attn = layer.self_attn
        if getattr(attn, "sliding_window", None) or not hasattr(attn, "scaling"):
            return None
    return LeanDecodeStep(model)
