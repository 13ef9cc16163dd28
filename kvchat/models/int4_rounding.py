"""int4 weights from fp32 ones: each group of inputs rounded to 16 levels between two ends, a bf16
scale and zero, value = (code - 8) * scale + zero, as models/quantize.py's Int4Linear holds them.

Each group's ends are searched: its min and its max, then each shrunk by a factor in CLIP_FACTORS, the
low end first, then the high one, where that lowers the group's squared error: an outlier clipped where
that serves the rest of the group. On SmolLM2's decoder weights quantized anew, KL against fp32 went
0.27 -> 0.20 in groups of 32 and 0.45 -> 0.28 in groups of 128 (scripts/README.md, Quantization); it
takes ~3x the time of min to max (a model with Qwen2.5-3B's shapes in ~90 s on one thread).
"""

from __future__ import annotations

import torch

CLIP_FACTORS = (1.0, 0.9, 0.8, 0.7)
SEARCH_ROWS = 256  # weight rows a step of the search: a few MB at a time, in cache


def round_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (N, n, G) uint8 in 0..15, and bf16 scales and zeros (N, n), of groups (N, n, G) of fp32
    weights."""
    codes = torch.empty(groups.shape, dtype=torch.uint8)
    scales = torch.empty(groups.shape[:2], dtype=torch.bfloat16)
    zeros = torch.empty_like(scales)
    for first in range(0, groups.shape[0], SEARCH_ROWS):
        rows = slice(first, first + SEARCH_ROWS)
        codes[rows], scales[rows], zeros[rows] = searched_ranges(groups[rows])
    return codes, scales, zeros


def searched_ranges(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (R, n, G) and bf16 scales and zeros (R, n) of groups (R, n, G) of fp32 weights, each group's
    range shrunk where that lowers its squared error (outliers clipped where that serves the rest): its
    low end by the best of CLIP_FACTORS, then its high end by the best. Scale and zero are rounded to
    bf16 before the codes are chosen, so the codes fit the values the kernel uses."""
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # (R, n)
    error = round_to(groups, low, high)[3]
    for end in ("low", "high"):
        for factor in CLIP_FACTORS[1:]:
            tried_low, tried_high = (low * factor, high) if end == "low" else (low, high * factor)
            tried = round_to(groups, tried_low, tried_high)[3]
            better = tried < error  # (R, n)
            error = torch.where(better, tried, error)
            low, high = torch.where(better, tried_low, low), torch.where(better, tried_high, high)
    codes, scales, zeros, _ = round_to(groups, low, high)
    return codes.to(torch.uint8), scales, zeros


def round_to(
    groups: torch.Tensor, low: torch.Tensor, high: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group (R, n, G) rounded to 16 levels from low to high (R, n): its codes, bf16 scales and
    zeros, and squared error (R, n)."""
    scales = ((high - low) / 15).clamp(min=1e-8).to(torch.bfloat16)
    zeros = (low + 8 * scales.float()).to(torch.bfloat16)
    step = scales.float()[..., None]
    exact = (groups - zeros.float()[..., None]).div_(step)  # the codes' values, less 8, unrounded
    codes = (exact + 8).round_().clamp_(0, 15)
    error = (codes - 8).sub_(exact).square_().sum(-1) * step[..., 0].square()  # (R, n)
    return codes, scales, zeros, error
