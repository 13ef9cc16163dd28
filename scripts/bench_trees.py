"""Decode and cold-prefill speed of this checkout of kvchat against another one (a worktree of main, say),
side by side: every measurement a fresh process with one checkout's kvchat on its path, the checkouts
taking turns (which goes first alternates by round), ratios taken pair by pair, medians reported.

    git worktree add ../kvchat-main main
    python scripts/bench_trees.py --other ../kvchat-main --kinds bf16 fp32 bf16-int8 bf16-int4 --rounds 5

Each process loads the packaged SmolLM2-135M in the kind asked for (dtype, then `--quantize`'s mode), one
thread, and measures: greedy decode tok/s after ~50 and ~2,000 tokens of context (prompt lookup off), and
the cold prefill of ~50 and ~2,000 tokens (seconds to the first token's logits, nothing reused). A ratio
above 1 means this checkout is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
MEASURES = ("decode@50", "decode@2000", "decode@4000", "prefill@50", "prefill@2000")


def worker(kind: str, measures: list[str], tokens: int, repeats: int, big: bool = False) -> dict[str, float]:
    """One process's `measures` for one kind, with whichever kvchat is on the path; on the packaged
    SmolLM2-135M, or with `big` on a random-weight model of Qwen2.5-3B's shapes (peer_runners.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvchat.engine.engine import Engine
    from kvchat.engine.sampling import SamplingParams
    from kvchat.models.packaged import ensure_converted

    torch.set_num_threads(1)
    dtype, _, mode = kind.partition("-")
    if big:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from peer_runners import make_big_model

        model = make_big_model(kind)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            ensure_converted(), dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        ).eval()
    if mode and not big:
        from kvchat.models.quantize import quantize_model

        quantize_model(model, mode)
    engine = Engine(model, kv_memory_bytes=768 << 20, block_size=16, prefill_chunk=512)
    figures: dict[str, float] = {}
    for name in measures:
        what, _, context = name.partition("@")
        prompt = [(i * 7919) % 40000 + 100 for i in range(int(context))]
        if what == "decode":
            params = SamplingParams(max_tokens=tokens)
            rates = [decode_rate(engine, prompt, tokens, params) for _ in range(repeats)]
            figures[name] = statistics.median(rates)
        else:
            figures[name] = statistics.median(cold_prefill(engine, prompt) for _ in range(repeats))
    return figures


def decode_rate(engine, prompt: list[int], tokens: int, params) -> float:
    """Greedy decode tok/s after `prompt` (its KV reused after the first call), one token a step."""
    from kvchat.engine.detokenizer import StreamDetokenizer
    from kvchat.engine.generate import GenerationStep, generate

    class NoText:
        def decode(self, ids, **kwargs) -> str:
            return ""

    seq = engine.start(prompt)
    try:
        steps = generate(engine, seq, params, frozenset(), StreamDetokenizer(NoText()))
        return [s for s in steps if isinstance(s, GenerationStep)][-1].stats.decode_tok_s
    finally:
        engine.free(seq)


def cold_prefill(engine, prompt: list[int]) -> float:
    """Seconds to compute `prompt` with nothing reused."""
    seq = engine.start(prompt, reuse=False, index=False)
    try:
        start = time.perf_counter()
        engine.compute(seq)
        return time.perf_counter() - start
    finally:
        engine.free(seq)


def measure(tree: Path, kind: str, args) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, __file__, "--worker", kind, "--tokens", str(args.tokens), "--repeats", "3"]
    command += ["--measures", *args.measures]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--other", type=Path, help="the other checkout (its root folder)")
    parser.add_argument("--kinds", nargs="+", default=["bf16", "fp32", "bf16-int8", "bf16-int4"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--measures", nargs="+", choices=MEASURES, default=list(MEASURES))
    parser.add_argument("--tokens", type=int, default=48, help="decoded tokens a timed run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--big", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.measures, args.tokens, args.repeats, args.big)))
        return
    if args.other is None:
        parser.error("--other is required")
    trees = {"this": HERE, "other": args.other.resolve()}
    runs: dict[tuple[str, str], list[dict[str, float]]] = {(k, t): [] for k in args.kinds for t in trees}
    for round_number in range(args.rounds):
        order = list(trees) if round_number % 2 == 0 else list(trees)[::-1]
        for kind in args.kinds:
            for tree in order:
                runs[kind, tree].append(measure(trees[tree], kind, args))
    print(f"| kind | measure | this | other | this vs other (median of {args.rounds} paired ratios) |")
    print("|---|---|---:|---:|---:|")
    for kind in args.kinds:
        for name in args.measures:
            mine = [r[name] for r in runs[kind, "this"]]
            theirs = [r[name] for r in runs[kind, "other"]]
            # a rate's ratio is this / other; a time's, other / this: above 1, this checkout is faster
            pairs = zip(mine, theirs, strict=True)
            ratios = [a / b if name.startswith("decode") else b / a for a, b in pairs]
            unit = "tok/s" if name.startswith("decode") else "s"
            figures = f"{statistics.median(mine):.3g} | {statistics.median(theirs):.3g}"
            print(f"| {kind} | {name} ({unit}) | {figures} | {statistics.median(ratios):.2f}x |")


if __name__ == "__main__":
    main()
