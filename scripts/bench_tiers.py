"""Decode speed of kvchat's CPU tiers side by side in one run, beside another checkout (a worktree of
main, say) and llama.cpp's `llama-bench` built for AVX2 from its source distribution:

    python scripts/bench_tiers.py --variants main=../kvchat-main avx512=.@avx512 avx2=.@avx2 \\
        portable=.@portable --llama-bench /path/to/avx2-build/bin/llama-bench --rounds 3

llama.cpp for AVX2 (a bench-only step, never CI), from llama-cpp-python's source distribution:

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-*.tar.gz
    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B avx2-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_AVX512=OFF -DGGML_FMA=ON -DGGML_F16C=ON \
        -DLLAMA_CURL=OFF && ninja -C avx2-build llama-bench

A variant is LABEL=CHECKOUT[@TIER]: a fresh process with that checkout's kvchat on its path and
KVCHAT_CPU_TIER set to TIER (none: the highest the CPU runs). Each process loads the packaged
SmolLM2-135M in each kind (bf16, then `--quantize`'s mode), one thread, and measures greedy decode
tok/s after ~50 and ~4,000 tokens of context (scripts/bench_trees.py's worker). llama-bench reads the
packaged model's own values as BF16, Q8_0 and Q4_1 files (scripts/peer_gguf.py), one thread, at the
same depths. With `--model big`, both take a random-weight model of Qwen2.5-3B's shapes instead (its
GGUF files BF16, Q8_0 and Q4_K, written once as bench_peer.py writes them: 11 GB; int4 against Q4_K,
both 4.5 bits a weight). The variants take turns, rounds alternating their order; the table gives each
variant's median and its median ratio to `--baseline` (above 1: faster than it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TREES = HERE / "bench_trees.py"
LLAMA_TYPES = {"bf16": "BF16", "bf16-int8": "Q8_0", "bf16-int4": "Q4_1", "fp32": "F32"}
# the 3B shapes' int4 takes 4.5 bits a weight, as Q4_K does (docs/benchmarks.md)
BIG_LLAMA_TYPES = {"bf16": "BF16", "bf16-int8": "Q8_0", "bf16-int4": "Q4_K"}


def kvchat_rates(
    tree: Path, tier: str | None, kind: str, measures: list[str], tokens: int, big: bool
) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    env.pop("KVCHAT_CPU_TIER", None)
    if tier:
        env["KVCHAT_CPU_TIER"] = tier
    command = [sys.executable, str(TREES), "--worker", kind, "--tokens", str(tokens), "--repeats", "2"]
    command += ["--big"] if big else []
    done = subprocess.run([*command, "--measures", *measures], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree}@{tier} {kind}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_rates(binary: Path, kind: str, measures: list[str], tokens: int, big: bool) -> dict[str, float]:
    from peer_gguf import big_path, packaged_as

    path = big_path(BIG_LLAMA_TYPES[kind]) if big else packaged_as(LLAMA_TYPES[kind])
    rates = {}
    for name in measures:
        depth = name.partition("@")[2]
        command = [str(binary), "-m", str(path), "-p", "0", "-n", str(tokens), "-d", depth, "-t", "1"]
        done = subprocess.run([*command, "-r", "2", "-o", "json"], capture_output=True, text=True, check=True)
        rates[name] = float(json.loads(done.stdout)[0]["avg_ts"])
    return rates


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--variants", nargs="+", required=True, help="LABEL=CHECKOUT[@TIER]")
    parser.add_argument("--llama-bench", type=Path, help="a llama-bench binary, measured as `llama`")
    parser.add_argument("--kinds", nargs="+", default=["bf16", "bf16-int8", "bf16-int4"])
    parser.add_argument("--measures", nargs="+", default=["decode@50", "decode@4000"])
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens a timed run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="the variant ratios are taken to (default: the first)")
    parser.add_argument("--model", choices=["smollm2", "big"], default="smollm2")
    args = parser.parse_args()
    big = args.model == "big"
    if big and args.llama_bench:
        from peer_runners import write_big_files

        write_big_files([BIG_LLAMA_TYPES[kind] for kind in args.kinds])
    from bench_common import machine

    print(machine())
    runners = {}
    for spec in args.variants:
        label, _, where = spec.partition("=")
        tree, _, tier = where.partition("@")
        runners[label] = lambda kind, tree=Path(tree), tier=tier or None: kvchat_rates(
            tree, tier, kind, args.measures, args.tokens, big
        )
    if args.llama_bench:
        runners["llama"] = lambda kind: llama_rates(args.llama_bench, kind, args.measures, args.tokens, big)
    baseline = args.baseline or next(iter(runners))
    runs: dict[tuple[str, str], list[dict[str, float]]] = {(k, v): [] for k in args.kinds for v in runners}
    for number in range(args.rounds):
        order = list(runners) if number % 2 == 0 else list(runners)[::-1]
        for kind in args.kinds:
            for label in order:
                if label == "llama" and kind not in LLAMA_TYPES:
                    continue
                runs[kind, label].append(runners[label](kind))
                told = f"round {number + 1}: {label} {kind} {runs[kind, label][-1]}"
                print(told, file=sys.stderr, flush=True)
    labels = list(runners)
    header = f"ratios to {baseline} (median of {args.rounds} rounds)"
    print(f"| kind | measure | {' | '.join(labels)} | {header} |")
    print("|---|---|" + "---:|" * (len(labels) + 1))
    for kind in args.kinds:
        for name in args.measures:
            cells, ratios = [], []
            for label in labels:
                mine = [r[name] for r in runs[kind, label]]
                base = [r[name] for r in runs[kind, baseline]]
                cells.append(f"{statistics.median(mine):.1f}" if mine else "-")
                if mine and base:
                    pairs = zip(mine, base, strict=True)
                    ratios.append(f"{label} {statistics.median(a / b for a, b in pairs):.2f}x")
            print(f"| {kind} | {name} (tok/s) | {' | '.join(cells)} | {', '.join(ratios)} |")


if __name__ == "__main__":
    main()
