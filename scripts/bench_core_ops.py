"""The kernels every tier shares (attention over the pool and the decoder-layer op's steps), timed as
each tier compiles them, side by side in one run:

    python scripts/bench_core_ops.py --variants avx512=.@avx512 avx2=.@avx2 main-avx2=../main@avx2

A variant is LABEL=CHECKOUT@TIER: a fresh process with that checkout's kvchat on its path and
KVCHAT_CPU_TIER set to TIER (its library built with that tier's flags: portable's with -O3 alone), one
thread, timing the ops on the same inputs: one decode token's attention over
~50 and ~4,000 past rows of a bf16 pool (SmolLM2-135M's heads and Qwen2.5-3B's), and the steps between
a layer's products (rms_norm, rope_write, silu_mul) at both models' widths. The variants take turns,
rounds alternating their order; the table gives each op's median microseconds and its median ratio to
the first variant's (above 1: slower than it).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# (name, kv heads, query heads a kv head, head dim, hidden, intermediate)
MODELS = [("smollm2", 3, 3, 64, 576, 1536), ("qwen2.5-3b", 2, 8, 128, 2048, 11008)]
CONTEXTS = (50, 4000)
POOL_SLOTS = 4096


def timed(run, repeats: int) -> float:
    """Median microseconds of one call over 7 batches of `repeats` calls."""
    for _ in range(3):
        run()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        times.append((time.perf_counter() - start) / repeats)
    return statistics.median(times) * 1e6


def worker() -> dict[str, float]:
    import torch

    from kvchat.native import kernels

    torch.set_num_threads(1)
    assert kernels.built(), kernels.build_error()
    ops, results = torch.ops.kvchat, {}
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    cases = []  # (name, op, its arguments, calls a batch)
    for name, kv_heads, group, head_dim, hidden, intermediate in MODELS:
        keys, values = randn(1, kv_heads, POOL_SLOTS, head_dim), randn(1, kv_heads, POOL_SLOTS, head_dim)
        query, scale = randn(kv_heads, group, head_dim), head_dim**-0.5
        for length in CONTEXTS:
            slots = torch.randperm(POOL_SLOTS, generator=generator)[:length]
            arguments = (query, keys, values, 0, slots, 1, scale)
            cases.append((f"{name} attention@{length}", ops.paged_attention, arguments, 200))
        cases.append((f"{name} rms_norm", ops.rms_norm, (randn(1, hidden), randn(hidden), 1e-6), 2000))
        cases.append((f"{name} silu_mul", ops.silu_mul, (randn(1, 2 * intermediate),), 2000))
        heads = kv_heads * group
        qkv, cos, sin = randn(1, (heads + 2 * kv_heads) * head_dim), randn(1, head_dim), randn(1, head_dim)
        arguments = (qkv, cos, sin, None, None, 1e-6, keys, values, 0, torch.tensor([7]), heads)
        cases.append((f"{name} rope_write", ops.rope_write, arguments, 2000))
    with torch.inference_mode():
        for name, op, arguments, repeats in cases:
            results[name] = timed(functools.partial(op, *arguments), repeats)
    return results


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    default = ["avx512=.@avx512", "avx2=.@avx2", "portable=.@portable"]
    parser.add_argument("--variants", nargs="+", default=default, help="LABEL=CHECKOUT@TIER")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker()))
        return
    from bench_common import machine

    print(machine())
    variants = {}
    for spec in args.variants:
        label, _, where = spec.partition("=")
        tree, _, tier = where.partition("@")
        variants[label] = (Path(tree).resolve(), tier)
    labels = list(variants)
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    for round_ in range(args.rounds):
        for label in labels if round_ % 2 == 0 else labels[::-1]:
            tree, tier = variants[label]
            env = {**os.environ, "KVCHAT_CPU_TIER": tier, "PYTHONPATH": str(tree)}
            command = [sys.executable, __file__, "--worker"]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            runs[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {round_ + 1}: {label}", file=sys.stderr)
    first = labels[0]
    print(f"| op | {' | '.join(f'{label} (us)' for label in labels)} | ratios to {first} |")
    print(f"|---|{'---:|' * len(labels)}---|")
    for name in runs[first][0]:
        medians = {label: statistics.median(run[name] for run in runs[label]) for label in labels}
        paired = {label: zip(runs[label], runs[first], strict=True) for label in labels[1:]}
        ratios = ", ".join(
            f"{label} {statistics.median(r[name] / b[name] for r, b in pairs):.2f}x"
            for label, pairs in paired.items()
        )
        print(f"| {name} | {' | '.join(f'{medians[label]:.1f}' for label in labels)} | {ratios} |")


if __name__ == "__main__":
    main()
