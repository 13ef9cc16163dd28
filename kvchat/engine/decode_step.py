"""The lean decode step: one token, or speculation's few, through a layer loop over the model's own
modules, without the module forward's cache and mask bookkeeping.

For a 135M model the weights take ~20 ms a token to read where the module forward took ~60; the rest
was per-op overhead and bf16 SDPA. The loop calls the model's own modules (norms, projections, MLP,
rotary embedding), so replaced linear layers (quantized ones) run unchanged. Only families whose
decoder layer it reproduces exactly take it (Llama, Qwen2, Qwen3, full attention); others keep the
module forward.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol

import torch

from kvchat.engine.paged_attention import grouped_attention

FAMILIES = frozenset({"llama", "qwen2", "qwen3"})
MAX_LEAN_TOKENS = 16  # beyond speculation's drafts a forward is a prefill, where SDPA is the better kernel


class KVStore(Protocol):
    def store(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep one layer's new K/V (1, Hk, q, D); return all of its K/V so far (1, Hk, T, D) each."""
        ...


class LeanDecodeStep:
    """Runs `num_new` <= MAX_LEAN_TOKENS tokens of a Llama-like model over the K/V a `KVStore` holds."""

    def __init__(self, model):
        self.base = model.model
        self.lm_head = model.lm_head
        first = self.base.layers[0].self_attn
        self.head_dim, self.scaling = first.head_dim, first.scaling
        self.has_qk_norm = hasattr(first, "q_norm")
        # the family's own RoPE function, from the module that defines its attention
        self.apply_rope: Callable = sys.modules[type(first).__module__].apply_rotary_pos_emb

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv: KVStore, num_logits: int
    ) -> torch.Tensor:
        """Logits of the last `num_logits` of the tokens (num_logits, V). input_ids, position_ids (1, q)."""
        hidden = self.base.embed_tokens(input_ids)  # (1, q, d)
        cos, sin = self.base.rotary_emb(hidden, position_ids)  # (1, q, D) each
        for index, layer in enumerate(self.base.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)  # (1, q, d)
            query, keys, values = self._project(attn, x)
            query, keys = self.apply_rope(query, keys, cos, sin)
            all_keys, all_values = kv.store(index, keys, values)  # (1, Hk, T, D) each
            out = grouped_attention(query, all_keys, all_values, self.scaling)  # (1, q, Hq*D)
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = self.base.norm(hidden[:, -num_logits:])  # (1, n, d)
        return self.lm_head(hidden)[0]  # (n, V)

    def _project(self, attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query (1, Hq, q, D), keys and values (1, Hk, q, D) before RoPE."""
        shape = (*x.shape[:-1], -1, self.head_dim)  # (1, q, H, D)
        query, keys = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
        if self.has_qk_norm:
            query, keys = attn.q_norm(query), attn.k_norm(keys)
        values = attn.v_proj(x).view(shape)
        return query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)


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
