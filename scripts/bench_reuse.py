"""Time to first token and fidelity of the reuse modes, side by side in one run, on a fixed set of
compositions over the real model:

  reorder  - passages (about --context-tokens in all) answered once, then asked about in another order;
  reuse    - an answer kept as an output, then reused as context after another system prompt.

For each composition and mode, a fresh session answers the first arrangement (so every chunk has KV
kept), then the second: its time to first token, then `verify` against a full recompute: KL of the
next-token distribution, top-1 agreement over --verify-tokens teacher-forced positions, and the
leading greedy tokens that agree.

    python scripts/bench_reuse.py --dtype bf16 --context-tokens 2000
"""

from __future__ import annotations

import gc
import importlib
import inspect
import random
import statistics

from bench_common import load, model_parser

from kvchat.chunks.compose import RepairPolicy
from kvchat.chunks.context import ContextManager
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import InferenceResult, ReuseMode
from kvchat.engine.engine import Engine
from kvchat.engine.sampling import SamplingParams

SOURCES = [
    "argparse",
    "subprocess",
    "logging",
    "pickle",
    "difflib",
    "textwrap",
    "unittest",
    "collections",
    "os",
    "json",
]
ONE_TOKEN = SamplingParams(max_tokens=1)


def _module_text(module) -> str:
    docs = [module.__doc__ or ""] + [
        inspect.getdoc(getattr(module, name)) or ""
        for name in sorted(dir(module))
        if not name.startswith("_")
    ]
    return " ".join(" ".join(docs).split())


def passages(tokenizer, total_tokens: int, count: int = 8) -> list[str]:
    """Real English text: the documentation of standard-library modules, cut to equal token counts."""
    texts = [_module_text(importlib.import_module(m)) for m in SOURCES]
    per = total_tokens // count
    out = []
    for text in texts:
        ids = tokenizer.encode(text)
        if len(ids) >= per:
            out.append(tokenizer.decode(ids[:per]))
        if len(out) == count:
            return out
    raise SystemExit(f"not enough text for {count} passages of {per} tokens")


def last(stream) -> InferenceResult:
    *_, result = stream
    return result


def reorder(cm: ContextManager, docs: list[str], seed: int) -> None:
    cm.set_system("You are a careful assistant. Answer from the passages.")
    ids = [cm.add_context(d).chunk_id for d in docs]
    cm.set_query("Which module do the passages describe first?")
    last(cm.infer(ONE_TOKEN))
    random.Random(seed).shuffle(ids)
    cm.middle = ids
    cm.set_query("Summarise the passage about logging in one sentence.")


def reuse(cm: ContextManager, docs: list[str], seed: int) -> None:
    cm.set_system("You are a helpful assistant.")
    for d in docs:
        cm.add_context(d)
    cm.set_query("Explain what these passages describe.")
    last(cm.infer(SamplingParams(max_tokens=48)))
    cm.clear()
    cm.set_system(f"You are a reviewer (session {seed}). Be brief and precise.")
    cm.use_output(1)
    for d in docs[seed % 3 :: 3]:
        cm.add_context(d)
    cm.set_query("Is the explanation above accurate?")


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--context-tokens", type=int, default=2000)
    parser.add_argument("--verify-tokens", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=3, help="compositions of each kind")
    parser.add_argument("--repair-share", type=float, default=0.15)
    parser.add_argument(
        "--modes", nargs="+", choices=[m.value for m in ReuseMode], default=[m.value for m in ReuseMode]
    )
    args = parser.parse_args()
    folder, model, tokenizer = load(args)
    docs = passages(tokenizer, args.context_tokens)
    modes = [ReuseMode(m) for m in args.modes]
    rows: dict[ReuseMode, list] = {mode: [] for mode in modes}
    for kind, setup in (("reorder", reorder), ("reuse", reuse)):
        for seed in range(args.seeds):
            for mode in modes:
                engine = Engine(model, kv_memory_bytes=512 << 20, block_size=16)
                cm = ContextManager(
                    engine, ChatFormat(tokenizer), tokenizer, frozenset({tokenizer.eos_token_id})
                )
                cm.repair = RepairPolicy(share=args.repair_share, min_tokens=4)
                setup(cm, docs, seed)
                cm.mode = mode
                result = last(cm.infer(ONE_TOKEN))
                report = cm.verify(args.verify_tokens)
                rows[mode].append((kind, result, report))
                del cm, engine
                gc.collect()  # the pool of the session just measured goes before the next one
                print(
                    f"{kind:<8} seed={seed} {mode.value:<10} ttft={result.ttft_s:7.3f}s "
                    f"reused={result.reused_tokens:5d} moved={result.repositioned_tokens:5d} "
                    f"computed={result.computed_tokens:5d} kl={report.kl_divergence:.4f} "
                    f"top1={report.top1_rate:.2f} greedy={report.greedy_agree}/{report.greedy_tokens}",
                    flush=True,
                )
    print(f"\nmodel={folder} dtype={args.dtype} threads={args.threads} context~{args.context_tokens} tokens")
    base = ReuseMode.EXACT if ReuseMode.EXACT in rows else modes[0]
    for kind in ("reorder", "reuse", "all"):
        print(f"\n{kind}:")
        print(f"| mode | median TTFT | vs {base.value} | median KL | top-1 agreement | greedy agreement |")
        print("|---|---:|---:|---:|---:|---:|")
        picked = {m: [(r, v) for k, r, v in data if kind in ("all", k)] for m, data in rows.items()}
        base_ttft = statistics.median(r.ttft_s for r, _ in picked[base])
        for mode, data in picked.items():
            ttft = statistics.median(r.ttft_s for r, _ in data)
            kl = statistics.median(v.kl_divergence for _, v in data)
            top1 = statistics.mean(v.top1_rate for _, v in data)
            greedy = statistics.mean(v.greedy_agree / v.greedy_tokens for _, v in data)
            speedup = base_ttft / ttft
            print(f"| {mode.value} | {ttft:.3f} s | {speedup:.1f}x | {kl:.4f} | {top1:.3f} | {greedy:.2f}")


if __name__ == "__main__":
    main()
