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


def rerotate_keys(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys (L, T, H, D) computed at positions p, returned as if computed at p + delta."""
    if delta == 0:
        return keys
    rot = 2 * inv_freq.shape[0]  # models with partial rotary leave the last dims unrotated
    angle = float(delta) * inv_freq.to(keys.device)  # (rot/2,)
    cos = torch.cat([angle.cos(), angle.cos()])  # (rot,)
    sin = torch.cat([angle.sin(), angle.sin()])
    k = keys[..., :rot].float()  # (L, T, H, rot)
    half = rot // 2
    rotated_half = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    out = keys.clone()
    out[..., :rot] = (k * cos + rotated_half * sin).to(keys.dtype)
    return out
