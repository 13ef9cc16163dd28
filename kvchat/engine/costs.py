"""Costs that drive a decision, measured once and kept here with how they were measured.

Speculation weighs the tokens a step may gain against what checking its drafts costs: a forward over the
last token and k drafts, in single-token steps of the same decode path. `scripts/bench_speculative.py`
measures that cost (the median of 7 rounds after ~50 tokens of context, SmolLM2-135M, one CPU thread)
and prints it beside `verify_cost`'s figure for the path it runs; the terms below were read off its
output, and a change to a kernel that moves them is measured again with it.

Why they differ by path: kvchat's kernels stream one row's weights at the machine's bandwidth, but each
further row costs them products (bf16 ones every eight rows, fp32 ones every four, integer ones each row
in int4 and int8); oneDNN's bf16 product shares its weight reads across rows, and MKL's fp32 product over
a few rows reads the weights at about half its one-row rate, hence its fixed term above one. Each draft
costs more as the context grows (its attention over every position).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VerifyCost:
    """A verification's cost in single-token steps: `fixed` (never below the one token it checks with)
    + `per_draft` * drafts, each term growing by its `_per_1k` for every 1,000 tokens of context
    (Engine.verify_cost adds them up)."""

    fixed: float
    fixed_per_1k: float
    per_draft: float
    per_draft_per_1k: float


# Per decode path (Engine.verify_cost picks one): the lean step over oneDNN's bf16 product (also what
# the module forward and a GPU are taken to cost), over kvchat's bf16 or fp32 kernels ("tiled"), over
# torch's bf16 product where oneDNN's takes no bf16 (UpcastLinear: a few rows cost nearly a token each;
# measured on an AVX2-only AMD EPYC), over MKL's fp32 product, and over kvchat's int4 and int8 kernels.
VERIFY_COSTS = {
    "lean": VerifyCost(1.0, 0.0, 0.03, 0.025),
    "lean-tiled": VerifyCost(1.0, 0.0, 0.2, 0.04),
    "lean-upcast": VerifyCost(1.1, 0.0, 0.6, 0.03),
    "lean-fp32": VerifyCost(1.7, 0.0, 0.04, 0.015),
    "lean-fp32-tiled": VerifyCost(1.0, 0.0, 0.13, 0.015),
    "lean-int4": VerifyCost(1.0, 0.0, 0.265, 0.04),
    "lean-int8": VerifyCost(1.0, 0.0, 0.2, 0.05),
}
