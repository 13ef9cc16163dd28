"""Decoding on CPU through the model's own weights: the lean decode step.

The lean step runs one token, or speculation's few, or a prefill chunk (batch invariance on), through a
layer loop over the model's weights, without the module forward's cache and mask bookkeeping. A decode
token reads every weight once, so what is not a matrix product is overhead: for a small model such as
SmolLM2-135M the module forward spends most of a token outside its products, and a loop over torch's
small ops (dozens a layer, each paying its dispatch) still spends a good share there
(scripts/bench_decode.py compares the paths). With kvchat's kernels built
(native/decode_layer.cpp) every layer runs in one op, `kvchat::decoder_layers`: its RMSNorms, its
rotation with the K/V written to the pool, its attention and silu(gate) * up are one C++ call each, its
projections one call of their kernel (query, key and value fused into one, and gate and up:
bf16_linears.fuse_tiled and quantized_linears.fuse_quantized), the residual additions inside the bf16
and fp32 kernels. It takes the linear layers of kvchat's kernels (bf16, fp32, int4, int8) and plain fp32
ones (torch's product).

There every row is computed alone, in one order of sums whatever rows come with it (kvchat's linear
kernels, attention over the pool in position order, the RMSNorms, rotation and silu a row at a time,
the rotation's cos and sin computed once per block of positions, `RotationTable`): a token's logits are
the same bits decoded alone, checked among drafts, or in a prefill chunk of any length after any
cached prefix (`batch_invariance` says where this holds).

Other linear layers (oneDNN's packed bf16, torch's int4 and int8), or no kernels at all, keep the
loop over the layers in Python, the model's modules called in turn: the same arithmetic in torch's
ops (the RMSNorms kvchat's one op where it is built). Only families whose decoder layer it
reproduces exactly take the lean step (Llama, Qwen2, Qwen3, full attention); others keep the module
forward.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from kvchat.linears.bf16_linears import TiledLinear, fuse_tiled
from kvchat.linears.quantized_linears import Int4Linear, Int8Linear, fuse_quantized
from kvchat.linears.rescored_head import RescoredHead
from kvchat.native import kernels

FAMILIES = frozenset({"llama", "qwen2", "qwen3"})
RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})  # weight * normalized x
# with batch invariance off, a forward of more tokens (a prefill) takes the module forward: SDPA, and
# AMX's tiles where the CPU has them
MAX_LEAN_TOKENS = 16
ROTATION_BLOCK = 64  # positions whose cos and sin RotationTable computes in one call


class KVStore(Protocol):
    @property
    def in_place(self) -> bool:
        """Whether `decoder_layers` serves (kvchat's kernels read the pool in place)."""
        ...

    def attend(
        self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Keep one layer's new K/V (1, Hk, q, D); return the causal attention of the queries
        (1, Hq, q, D) over all of its K/V so far, (1, q, Hq * D)."""
        ...

    def decoder_layers(
        self,
        hidden: torch.Tensor,
        parts: list[torch.Tensor | None],
        eps: float,
        rotation: tuple[torch.Tensor, torch.Tensor],
        num_heads: int,
        scaling: float,
    ) -> torch.Tensor:
        """Every decoder layer in kvchat::decoder_layers (`layer_parts`), K/V kept: (q, d) -> (q, d)."""
        ...


def projection_parts(linear, dtype: torch.dtype) -> list[torch.Tensor | None] | None:
    """A linear layer as kvchat::decoder_layers takes it, (a, b, bias), or None where it takes no such
    layer: bf16 tiles, kvchat's int4 or int8 codes with their scales, or a plain weight of `dtype`."""
    if isinstance(linear, TiledLinear):
        return [linear.tiles, None, linear.bias]
    if isinstance(linear, Int4Linear) and linear.kernel == "kvchat":
        return [linear.packed, linear.params, linear.bias]
    if isinstance(linear, Int8Linear) and linear.kernel == "kvchat":
        return [linear.codes, linear.scales, linear.bias]
    if type(linear) is nn.Linear and linear.weight.dtype == dtype:
        return [linear.weight, None, linear.bias]
    return None


Parts = list[torch.Tensor | None]


def layer_parts(layers, silu: bool, dtype: torch.dtype) -> tuple[Parts, float] | None:
    """What kvchat::decoder_layers takes for these layers (25 tensors a layer, in its order: the norms'
    weights, then each projection's `projection_parts`) and their norms' eps; None unless every linear
    is one it takes, the MLPs silu ones and the norms the families' RMSNorms of one eps, their weights
    of the model's `dtype`. Query, key and value (gate and up) of one kind are fused into one projection
    (`fused_parts`), given in the first one's place, the others' left None."""
    parts: Parts = []
    eps: set[float] = set()
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        head_norms = [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else []
        norms = [layer.input_layernorm, layer.post_attention_layernorm, *head_norms]
        kinds = {(type(norm).__name__ in RMS_NORMS, norm.weight.dtype) for norm in norms}
        if not silu or kinds != {(True, dtype)}:
            return None
        eps.update(norm.variance_epsilon for norm in norms)
        parts += [norm.weight for norm in norms] + [None] * (4 - len(norms))
        for group in ([attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj]):
            fused = fused_parts(group, dtype) if len(group) > 1 else None
            if fused is not None:
                parts += fused
                parts += [None] * 3 * (len(group) - 1)
                continue
            for linear in group:
                given = projection_parts(linear, dtype)
                if given is None:
                    return None
                parts += given
        given = projection_parts(mlp.down_proj, dtype)
        if given is None:
            return None
        parts += given
    return (parts, eps.pop()) if len(eps) == 1 else None


def fused_parts(linears: list[nn.Module], dtype: torch.dtype) -> Parts | None:
    """Several projections of one input as one, as `projection_parts` gives it: bf16 tiles
    (bf16_linears.fuse_tiled) or int4/int8 codes (quantized_linears.fuse_quantized); None where they
    differ."""
    tiled = fuse_tiled(linears)
    return projection_parts(tiled, dtype) if tiled is not None else fuse_quantized(linears)


class RotationTable:
    """`rope`'s cos and signed sin by position, computed ROTATION_BLOCK positions a call and kept: a
    position's rotation is then the same bits in every forward (torch's cos and sin compute a tensor's
    last values with other code than the rest, so a position's values could depend on the forward's
    length). Only for a rotary embedding whose frequencies do not change with the length."""

    def __init__(self, base):
        self.base = base
        self.cos: torch.Tensor | None = None  # (P, D), P a whole number of blocks
        self.sin: torch.Tensor | None = None

    @staticmethod
    def takes(base) -> bool:
        """Whether the model's rotary embedding is fixed: not dynamic NTK or LongRoPE, whose
        frequencies follow the length."""
        rope_type = str(getattr(base.rotary_emb, "rope_type", "default"))
        return "dynamic" not in rope_type and "longrope" not in rope_type

    def __call__(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of positions (1, q), as `rotation` gives them: (1, 1, q, D) each."""
        positions = position_ids[0]  # (q,)
        self._cover(hidden, int(positions.max()) + 1)
        assert self.cos is not None and self.sin is not None
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)  # (q, D)
        return cos[None, None], sin[None, None]

    def _cover(self, hidden: torch.Tensor, num_positions: int) -> None:
        have = 0 if self.cos is None else self.cos.shape[0]
        if num_positions <= have:
            return
        want = max(num_positions, 2 * have)  # grown by doubling, block by block
        cos_pieces = [] if self.cos is None else [self.cos]
        sin_pieces = [] if self.sin is None else [self.sin]
        for start in range(have, want, ROTATION_BLOCK):
            block = torch.arange(start, start + ROTATION_BLOCK, device=hidden.device)[None]  # (1, B)
            cos, sin = rotation(self.base, hidden, block)  # (1, 1, B, D) each
            cos_pieces.append(cos[0, 0])
            sin_pieces.append(sin[0, 0])
        self.cos, self.sin = torch.cat(cos_pieces), torch.cat(sin_pieces)


class LeanDecodeStep:
    """Runs new tokens of a Llama-like model over the K/V a `KVStore` holds: in kvchat::decoder_layers
    where it takes the model (`parts`), any number of them, else a layer at a time (at most
    MAX_LEAN_TOKENS)."""

    def __init__(self, model):
        self.base = model.model
        self.lm_head = model.lm_head
        first = self.base.layers[0].self_attn
        self.head_dim, self.scaling = first.head_dim, first.scaling
        self.num_heads = model.config.num_attention_heads
        self.has_qk_norm = hasattr(first, "q_norm")
        param = next(model.parameters())
        on_cpu = param.device.type == "cpu" and param.dtype in kernels.NATIVE_DTYPES
        native = on_cpu and kernels.decoder_layers() is not None
        silu = getattr(model.config, "hidden_act", None) == "silu"
        self.parts = layer_parts(self.base.layers, silu, param.dtype) if native else None
        self.rotations = RotationTable(self.base) if RotationTable.takes(self.base) else None

    def batch_invariance(self) -> str | None:
        """Why a token's logits may depend on the tokens computed with it, or None where they do not
        (with attention read in place from the pool, `KVStore.in_place`)."""
        if self.parts is None:
            return "its decoder layers are not all on kvchat's kernels"
        if self.rotations is None:
            return "its rotary embedding changes with the length"
        head = self.lm_head
        if isinstance(head, RescoredHead):
            head = head.coarse if kernels.rescore_top() is not None else None
        native_head = isinstance(head, TiledLinear) or (
            isinstance(head, Int4Linear | Int8Linear) and head.kernel == "kvchat"
        )
        return None if native_head else "its output layer is not on kvchat's kernels"

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv: KVStore, num_logits: int
    ) -> torch.Tensor:
        """Logits of the last `num_logits` of the tokens (num_logits, V). input_ids, position_ids (1, q)."""
        hidden = self.base.embed_tokens(input_ids)  # (1, q, d)
        rotate = self.rotations or (lambda x, positions: rotation(self.base, x, positions))
        cos, sin = rotate(hidden, position_ids)  # (1, 1, q, D) each
        if self.parts is not None and kv.in_place:
            parts, eps = self.parts
            rotated = cos.view(-1, self.head_dim), sin.view(-1, self.head_dim)  # (q, D) each
            hidden = kv.decoder_layers(hidden[0], parts, eps, rotated, self.num_heads, self.scaling)[None]
        else:
            hidden = self._layers(hidden, kv, cos, sin)
        hidden = rms_norm(self.base.norm, hidden[:, -num_logits:])  # (1, n, d)
        return self.lm_head(hidden)[0]  # (n, V)

    def _layers(
        self, hidden: torch.Tensor, kv: KVStore, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """The decoder layers a layer at a time, through the model's modules."""
        for index, layer in enumerate(self.base.layers):
            attn = layer.self_attn
            x = rms_norm(layer.input_layernorm, hidden)  # (1, q, d)
            query, keys, values = self._project(attn, x)
            query, keys = rope(query, cos, sin), rope(keys, cos, sin)
            out = kv.attend(index, query, keys, values, self.scaling)  # (1, q, Hq*D)
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + layer.mlp(rms_norm(layer.post_attention_layernorm, hidden))
        return hidden

    def _project(self, attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query (1, Hq, q, D), keys and values (1, Hk, q, D) before RoPE."""
        shape = (*x.shape[:-1], -1, self.head_dim)  # (1, q, H, D)
        query, keys = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
        if self.has_qk_norm:
            query, keys = rms_norm(attn.q_norm, query), rms_norm(attn.k_norm, keys)
        values = attn.v_proj(x).view(shape)
        return query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """The families' RMSNorm module applied to `x`, by kvchat's one op where built (native/kernels.py
    falls back to torch's fused kernel: 4 ops where the module runs 8); other norms run themselves."""
    if type(norm).__name__ not in RMS_NORMS:
        return norm(x)
    return kernels.rms_norm(x, norm.weight, norm.variance_epsilon)


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
