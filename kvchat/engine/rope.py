"""Moving cached keys to new positions: transformers caches keys after RoPE, so a chunk placed at
another position needs its keys rotated by the position delta. Always from the original keys, in
fp32, never cumulatively (repeated shifts drift into nonsense)."""

from __future__ import annotations

import torch


def rotary_inv_freq(model) -> torch.Tensor:
    """The inverse frequencies of the model's rotary embedding: (rot_dim / 2,) fp32."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise ValueError(f"{type(model).__name__} has no rotary embedding to re-rotate keys with")
    return rotary.inv_freq.float()


def rerotate_keys_(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate keys (L, T, H, D) computed at positions p, in place, to positions p + delta."""
    if delta == 0:
        return keys
    half = inv_freq.shape[0]  # models with partial rotary leave the dims past 2 * half unrotated
    angle = float(delta) * inv_freq.to(keys.device)  # (half,)
    cos, sin = angle.cos(), angle.sin()
    k1, k2 = keys[..., :half].float(), keys[..., half : 2 * half].float()  # (L, T, H, half); views if fp32
    # transformers' rotate_half layout: (k1, k2) -> (k1 cos - k2 sin, k2 cos + k1 sin)
    first, second = k1 * cos - k2 * sin, k2 * cos + k1 * sin
    keys[..., :half], keys[..., half : 2 * half] = first, second
    return keys
