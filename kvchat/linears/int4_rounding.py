"""int4 weights from fp32 ones: each group of inputs rounded to 16 levels between two ends, as
linears/quantized_linears.py's Int4Linear holds them: with a bf16 scale and zero a group
(`GroupScales`), or, in groups of 32, nested (`NestedScales`): 8-bit scale and low codes a group under
bf16 factors per row, 4.5 bits a weight where bf16 scales and zeros take 5 (llama.cpp's Q4_K nests
6-bit codes under factors per 8 groups, also 4.5).
On SmolLM2's decoder weights quantized anew, nested per row, nested per 8 groups and bf16 groups of 32
scored the same: weight error 0.0696, 0.0696 and 0.0695, error of the linears' outputs on the model's
own inputs to them (input channels up to 1,000x the median) 0.0672 for all three, KL against fp32
0.186, 0.194 and 0.196 in one run. 6-bit codes per 8 groups, as Q4_K: weight error 0.0708, outputs
0.0684.

Each group's ends are searched: its min and its max, then each shrunk by a factor in CLIP_FACTORS, the
low end first, then the high one, where that lowers the group's squared error: an outlier clipped where
that serves the rest of the group. On SmolLM2's decoder weights quantized anew, KL against fp32 went
0.27 -> 0.20 in groups of 32 and 0.45 -> 0.28 in groups of 128 (scripts/bench_quant.py quality); it
takes ~3x the time of min to max (a model with Qwen2.5-3B's shapes in ~90 s on one thread).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

CLIP_FACTORS = (1.0, 0.9, 0.8, 0.7)
SEARCH_ROWS = 256  # weight rows a step of the search: a few MB at a time, in cache
SCALE_CODES = 255  # a nested group's scale is 1..255 row scales
LOW_CODES = 127  # and its low -127..127 row lows


@dataclass
class GroupScales:
    """A bf16 scale and zero per group, (N, n) each: value = (code - 8) * scale + zero."""

    scales: torch.Tensor
    zeros: torch.Tensor

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's scale and low (the value of code 0) in fp32, (N, n) each."""
        scales = self.scales.float()
        return scales, self.zeros.float() - 8 * scales


@dataclass
class NestedScales:
    """Per group: a scale code (N, n) uint8 and a low code (N, n) int8; per row: a bf16 row scale and row
    low (N,). A group's scale is its code times its row's scale, its low its code times the row's low:
    value = code * scale + low."""

    scale_codes: torch.Tensor
    low_codes: torch.Tensor
    row_scales: torch.Tensor
    row_lows: torch.Tensor

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's scale and low in fp32, (N, n) each."""
        scales = self.scale_codes.float() * self.row_scales.float()[:, None]
        return scales, self.low_codes.float() * self.row_lows.float()[:, None]


def round_groups(
    groups: torch.Tensor, nested: bool = False
) -> tuple[torch.Tensor, GroupScales | NestedScales]:
    """Codes (N, n, G) uint8 in 0..15 of groups (N, n, G) of fp32 weights, and their scales: a bf16
    scale and zero a group, or nested."""
    codes = torch.empty(groups.shape, dtype=torch.uint8, device=groups.device)
    parts: list[GroupScales | NestedScales] = []
    for first in range(0, groups.shape[0], SEARCH_ROWS):
        rows = groups[first : first + SEARCH_ROWS]
        low, high = searched_ends(rows)
        if nested:
            codes[first : first + SEARCH_ROWS], nested_scales = nested_round(rows, low, high)
            parts.append(nested_scales)
        else:
            group_codes, scales, zeros, _ = round_to(rows, low, high)
            codes[first : first + SEARCH_ROWS] = group_codes
            parts.append(GroupScales(scales, zeros))
    kind = type(parts[0])
    return codes, kind(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(kind)))


def searched_ends(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The low and high ends (R, n) to round groups (R, n, G) of fp32 weights between: each group's
    min and max, shrunk where that lowers the group's squared error (outliers clipped where that serves
    the rest): the low end by the best of CLIP_FACTORS, then the high end by the best. The error is
    taken with bf16 scales and zeros, rounded before the codes are chosen, as the kernel uses them."""
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # (R, n)
    error = round_to(groups, low, high)[3]
    for end in ("low", "high"):
        for factor in CLIP_FACTORS[1:]:
            tried_low, tried_high = (low * factor, high) if end == "low" else (low, high * factor)
            tried = round_to(groups, tried_low, tried_high)[3]
            better = tried < error  # (R, n)
            error = torch.where(better, tried, error)
            low, high = torch.where(better, tried_low, low), torch.where(better, tried_high, high)
    return low, high


def nested_round(
    groups: torch.Tensor, low: torch.Tensor, high: torch.Tensor
) -> tuple[torch.Tensor, NestedScales]:
    """Groups (R, n, G) rounded to 16 levels from about low to high (R, n), with nested scales: each
    row's scale its largest group scale / SCALE_CODES, its low its largest |low| / LOW_CODES (in bf16);
    each group's low code rounded, then its scale code to span what is left of its range; then the
    codes (R, n, G) against the values those give."""

    def per_row(values: torch.Tensor, codes: int) -> torch.Tensor:  # (R,) bf16
        return (values.amax(-1) / codes).clamp(min=1e-30).to(torch.bfloat16)

    row_scales = per_row((high - low) / 15, SCALE_CODES)
    row_lows = per_row(low.abs(), LOW_CODES)
    low_codes = (low / row_lows.float()[:, None]).round_().clamp_(-LOW_CODES, LOW_CODES)
    lows = low_codes * row_lows.float()[:, None]
    scale_codes = ((high - lows) / 15 / row_scales.float()[:, None]).round_().clamp_(1, SCALE_CODES)
    scales = scale_codes * row_scales.float()[:, None]
    codes = ((groups - lows[..., None]) / scales[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    nested = NestedScales(scale_codes.to(torch.uint8), low_codes.to(torch.int8), row_scales, row_lows)
    return codes, nested


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
