"""Moving cached keys to new positions: transformers caches keys after RoPE, so a chunk placed at
another position needs its keys rotated by the position delta. Always from the original keys, in
fp32, never cumulatively (repeated shifts drift into nonsense).

The rotation comes from the model's own rotary embedding, asked for cos and sin at the delta, per layer:
each layer type keeps its own frequencies (Gemma 3: 10,000 on sliding-window layers, 1,000,000 on
global ones), partial rotary rotates only the first dimensions (Phi-4-mini, StableLM: cos is that
long), and the scaled variants (linear, llama3, YaRN) are the module's frequencies as they are. YaRN
also scales cos and sin by an attention factor, which the cached keys already carry: the rotation by
the delta is cos and sin at the delta over those at position 0. A rotary embedding whose frequencies
change with the sequence length (dynamic NTK, LongRoPE) cannot move keys exactly: `refusal` names it.
"""

from __future__ import annotations

import inspect

import torch

# rope types whose frequencies depend on the longest position seen: keys cannot be re-rotated exactly
_LENGTH_DEPENDENT = {"dynamic": "dynamic NTK", "longrope": "LongRoPE"}


def _base(model):
    return getattr(model, "model", model)


def _rope_types(rotary) -> list[str]:
    kind = getattr(rotary, "rope_type", "default")
    return [str(v) for v in kind.values()] if isinstance(kind, dict) else [str(kind)]


def refusal(model) -> str | None:
    """Why keys of this model cannot be moved to other positions exactly, or None when they can."""
    rotary = getattr(_base(model), "rotary_emb", None)
    if rotary is None:
        return f"{type(model).__name__} has no rotary embedding kvchat can re-rotate keys with"
    for kind in _rope_types(rotary):
        for marker, name in _LENGTH_DEPENDENT.items():
            if marker in kind:
                return (
                    f"its RoPE scaling ({name}) changes with the sequence length, so moved keys cannot "
                    "be re-rotated exactly"
                )
    return None


class KeyRotation:
    """Re-rotation of a model's cached keys by a position delta, layer by layer."""

    def __init__(self, model) -> None:
        reason = refusal(model)
        if reason is not None:
            raise ValueError(reason)
        self._rotary = _base(model).rotary_emb
        num_layers = model.config.num_hidden_layers
        takes_type = "layer_type" in inspect.signature(self._rotary.forward).parameters
        layer_types = getattr(model.config, "layer_types", None) if takes_type else None
        # each layer's argument to the rotary embedding: its layer type, or None where there is one table
        self.layer_keys: list[str | None] = [
            layer_types[i] if layer_types else None for i in range(num_layers)
        ]

    def cos_sin(self, delta: int, layer_key: str | None, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation by `delta` positions: cos and sin (rot_dim,) in fp32."""
        probe = torch.zeros(1, dtype=torch.float32, device=device)
        positions = torch.tensor([[0, delta]], device=device)  # (1, 2)
        extra = () if layer_key is None else (layer_key,)
        cos, sin = self._rotary(probe, positions, *extra)  # (1, 2, rot_dim) each
        scale = cos[0, 0]  # the attention factor (YaRN), 1 elsewhere: cos(0) times it
        return (cos[0, 1] / scale).float(), (sin[0, 1] / scale).float()

    def rotate_(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Rotate keys (L, T, H, D) computed at positions p, in place, to positions p + delta."""
        if delta == 0:
            return keys
        for layer_key in dict.fromkeys(self.layer_keys):
            layers = [i for i, k in enumerate(self.layer_keys) if k == layer_key]
            cos, sin = self.cos_sin(delta, layer_key, keys.device)
            index = torch.tensor(layers, device=keys.device)
            keys[index] = rotate(keys[index], cos, sin)
        return keys


def rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half rotation of the first cos.shape[-1] dims of keys (..., D) by cos and
    sin (rot_dim,), in fp32; the dims past them (partial rotary) stay as they are."""
    rot, half = cos.shape[-1], cos.shape[-1] // 2
    k = keys[..., :rot].float()  # (..., rot)
    rotated = torch.cat([-k[..., half:], k[..., :half]], dim=-1)  # rotate_half
    out = keys.clone()
    out[..., :rot] = (k * cos + rotated * sin).to(keys.dtype)
    return out


def layer_position_embeddings(base, hidden: torch.Tensor, position_ids: torch.Tensor) -> list:
    """Each decoder layer's (cos, sin) at `position_ids`, as the model's own forward gives them: one
    table for all layers, or one per layer type (Gemma 3)."""
    rotary = base.rotary_emb
    layer_types = getattr(base.config, "layer_types", None)
    if layer_types is None or "layer_type" not in inspect.signature(rotary.forward).parameters:
        shared = rotary(hidden, position_ids)
        return [shared] * len(base.layers)
    by_type = {kind: rotary(hidden, position_ids, kind) for kind in set(layer_types)}
    return [by_type[layer_types[i]] for i in range(len(base.layers))]
