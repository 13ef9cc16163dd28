"""Time to first token and fidelity of the reuse modes, side by side in one run, on a fixed set of
compositions of eight passages (--sizes tokens in all) over the real model:

  reorder - the passages answered once, then asked about in another order;
  system  - the same passages, in the same order, under another system prompt;
  output  - an answer kept as an output, then reused after other passages than those it followed;
  far     - the first passage moved to the end, after all the others (another question each seed).

Each seed first shuffles the passages, so every seed composes them differently.
For each composition and variant, a fresh session answers the first arrangement (so every chunk has KV
kept), then the second: its time to first token, then `verify` against a full recompute: KL of the
next-token distribution, top-1 agreement over --verify-tokens teacher-forced positions, the share of
leading greedy tokens that agree, and the share of moved tokens that repair recomputed.

A variant is a mode, or a repair strategy with its share and options: exact, reposition,
prefix:0.15, deviation:0.15. Deviation's options, after commas: probe=2 (probe at layer 2, not 1),
heads=4 (each moved chunk's first 4 tokens are among those recomputed), taper=0.5 (progressive: the
selection narrows after every layer, see kvchat.chunks.compose.RepairPolicy).

Two recompute shares are reported: "recomputed", the moved tokens that repair recomputed (for
progressive selection: through at least the first layer after the probe), and "compute", the moved
tokens' layer computations that repair ran, over the moved tokens times the layers (for deviation it
counts the probe layers, which run over every moved token).

    python scripts/bench_reuse.py --dtype bf16 --threads 1 --sizes 1000 2000
"""

from __future__ import annotations

import copy
import gc
import importlib
import inspect
import random
import statistics
from dataclasses import dataclass

from bench_common import load, model_parser

from kvchat.chunks.compose import NO_REPAIR, RepairPolicy
from kvchat.chunks.context import ContextManager
from kvchat.chunks.reports import FidelityReport
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import InferenceResult, RepairStrategy, ReuseMode
from kvchat.engine.engine import Engine
from kvchat.engine.sampling import SamplingParams

SOURCES = ["argparse", "subprocess", "logging", "pickle", "difflib", "textwrap", "unittest", "collections"]
SYSTEM = "You are a careful assistant. Answer from the passages."
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
    per = total_tokens // count
    out = []
    for name in SOURCES:
        ids = tokenizer.encode(_module_text(importlib.import_module(name)))
        if len(ids) >= per:
            out.append(tokenizer.decode(ids[:per]))
    if len(out) < count:
        raise SystemExit(f"not enough text for {count} passages of {per} tokens")
    return out[:count]


def last(stream) -> InferenceResult:
    *_, result = stream
    return result


def first_pass(cm: ContextManager, docs: list[str], system: str = SYSTEM) -> list[str]:
    cm.set_system(system)
    ids = [cm.add_context(d).chunk_id for d in docs]
    cm.set_query("Which module do the passages describe first?")
    last(cm.infer(ONE_TOKEN))
    return ids


def reorder(cm: ContextManager, docs: list[str], seed: int) -> None:
    ids = first_pass(cm, docs)
    cm.middle = ids[seed % 2 :: 2] + ids[1 - seed % 2 :: 2]  # every passage moves
    cm.set_query("Summarise the passage about logging in one sentence.")


def system(cm: ContextManager, docs: list[str], seed: int) -> None:
    first_pass(cm, docs)
    cm.set_system(f"You are a reviewer (session {seed}). Be brief and precise, and cite the passages.")
    cm.set_query("Summarise the passage about logging in one sentence.")


def output(cm: ContextManager, docs: list[str], seed: int) -> None:
    half = len(docs) // 2
    cm.set_system(SYSTEM)
    for d in docs[:half]:
        cm.add_context(d)
    cm.set_query("Explain what these passages describe.")
    last(cm.infer(SamplingParams(max_tokens=48)))
    cm.clear()
    first_pass(cm, docs[half:])  # the other passages, kept at other positions
    cm.clear()
    cm.set_system(SYSTEM)
    for d in docs[half + seed % 2 :] + docs[half : half + seed % 2]:
        cm.add_context(d)
    cm.use_output(1)
    cm.set_query("Is the explanation above accurate?")


def far(cm: ContextManager, docs: list[str], seed: int) -> None:
    ids = first_pass(cm, docs)
    cm.middle = ids[1:] + ids[:1]
    queries = ["What does the last passage describe?", "Which passages mention files, and how?"]
    cm.set_query(queries[seed % 2])


SETS = {"reorder": reorder, "system": system, "output": output, "far": far}


@dataclass(frozen=True)
class Variant:
    name: str
    mode: ReuseMode
    repair: RepairPolicy

    @classmethod
    def parse(cls, text: str) -> Variant:
        kind, _, rest = text.partition(":")
        if kind in ("exact", "reposition"):
            return cls(text, ReuseMode(kind), NO_REPAIR)
        share, *options = rest.split(",") if rest else ["0.15"]
        named = dict(option.split("=") for option in options)
        policy = RepairPolicy(
            share=float(share),
            min_tokens=int(named.pop("heads", 0)),
            strategy=RepairStrategy(kind),
            taper=float(named.pop("taper", 0)),
            probe_layer=int(named.pop("probe", 1)),
        )
        if named:
            raise SystemExit(f"unknown options in {text}: {', '.join(named)}")
        return cls(text, ReuseMode.REPAIR, policy)


@dataclass(frozen=True)
class Row:
    size: int
    kind: str
    variant: str
    result: InferenceResult
    report: FidelityReport
    compute: float  # the moved tokens' layer computations repair ran, over moved tokens x layers

    @property
    def share(self) -> float:
        recomputed = sum(c.num_recomputed for c in self.result.chunks)
        moved = self.result.repositioned_tokens + recomputed
        return recomputed / moved if moved else 0.0


def arranged(model, tokenizer, kind: str, seed: int, docs: list[str], size: int) -> ContextManager:
    """A session that answered the first arrangement and holds the second, not yet answered."""
    # Room for the kept chunks, the live sequence and /verify's two copies of the context.
    engine = Engine(model, kv_memory_bytes=max(512, size // 3) << 20, block_size=16, prefill_chunk=512)
    cm = ContextManager(engine, ChatFormat(tokenizer), tokenizer, frozenset({tokenizer.eos_token_id}))
    SETS[kind](cm, random.Random(seed).sample(docs, len(docs)), seed)  # each seed its own order
    return cm


def run_one(base: ContextManager, size: int, kind: str, variant: Variant, verify: int) -> Row:
    # Each variant starts from its own copy of the arranged session (the model is shared): what one
    # variant computes and caches cannot serve another.
    cm = session_copy(base, variant)
    result = last(cm.infer(ONE_TOKEN))
    row = Row(size, kind, variant.name, result, cm.verify(verify), compute_share(base, variant))
    del cm
    gc.collect()  # the pool of the session just measured goes before the next one
    return row


def session_copy(base: ContextManager, variant: Variant) -> ContextManager:
    model = base.engine.model  # shared, with every module and weight the decode step holds of it
    shared = [model, base.tokenizer, *model.modules(), *model.parameters(), *model.buffers()]
    cm = copy.deepcopy(base, memo={id(obj): obj for obj in shared})
    cm.mode, cm.repair = variant.mode, variant.repair
    return cm


def compute_share(base: ContextManager, variant: Variant) -> float:
    """The variant's context composed on another copy of the session (the selection is deterministic):
    the share of the moved tokens' layer computations that its repair ran."""
    cm, repair = session_copy(base, variant), variant.repair
    composed = cm.compose()
    moved = composed.num_repositioned + len(composed.recomputed)
    if not moved or not composed.recomputed:
        return 0.0
    layers = cm.engine.num_layers
    if repair.strategy is RepairStrategy.PREFIX:
        return len(composed.recomputed) / moved
    return ((repair.probe_layer + 1) * moved + sum(composed.recompute_layers)) / (layers * moved)


def table(rows: list[Row], variants: list[str], title: str) -> None:
    print(f"\n{title}:")
    print(
        "| variant | median TTFT | vs exact | median KL | top-1 | top-1 gap closed | greedy | recomputed "
        "| compute |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    by = {v: [r for r in rows if r.variant == v] for v in variants}
    exact_ttft = statistics.median(r.result.ttft_s for r in by["exact"]) if by.get("exact") else None
    moved_top1 = (
        statistics.mean(r.report.top1_rate for r in by["reposition"]) if by.get("reposition") else None
    )
    for name, data in by.items():
        ttft = statistics.median(r.result.ttft_s for r in data)
        top1 = statistics.mean(r.report.top1_rate for r in data)
        speed = f"{exact_ttft / ttft:.1f}x" if exact_ttft else "-"
        closed = "-"
        if moved_top1 is not None and moved_top1 < 1 and name not in ("exact", "reposition"):
            closed = f"{(top1 - moved_top1) / (1 - moved_top1):.0%}"
        kl = statistics.median(r.report.kl_divergence for r in data)
        greedy = statistics.mean(r.report.greedy_agree / r.report.greedy_tokens for r in data)
        share = statistics.mean(r.share for r in data)
        compute = statistics.mean(r.compute for r in data)
        print(
            f"| {name} | {ttft:.3f} s | {speed} | {kl:.4f} | {top1:.3f} | {closed} "
            f"| {greedy:.2f} | {share:.0%} | {compute:.0%} |"
        )


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 2000], help="tokens of passages")
    parser.add_argument("--sets", nargs="+", choices=list(SETS), default=list(SETS))
    parser.add_argument("--verify-tokens", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=3, help="compositions of each kind")
    parser.add_argument(
        "--variants", nargs="+", default=["exact", "reposition", "prefix:0.15", "deviation:0.15,heads=4"]
    )
    args = parser.parse_args()
    folder, model, tokenizer = load(args)
    variants = [Variant.parse(v) for v in args.variants]
    names = [v.name for v in variants]
    rows: list[Row] = []
    for size in args.sizes:
        docs = passages(tokenizer, size)
        for kind in args.sets:
            for seed in range(args.seeds):
                base = arranged(model, tokenizer, kind, seed, docs, size)
                for variant in variants:  # interleaved, so machine noise hits every variant alike
                    row = run_one(base, size, kind, variant, args.verify_tokens)
                    rows.append(row)
                    r, v = row.result, row.report
                    print(
                        f"{size:5d} {kind:<8} seed={seed} {variant.name:<16} ttft={r.ttft_s:7.3f}s "
                        f"prompt={r.prompt_tokens:5d} moved={r.repositioned_tokens:5d} share={row.share:.2f} "
                        f"compute={row.compute:.2f} "
                        f"kl={v.kl_divergence:.4f} top1={v.top1_rate:.2f} "
                        f"greedy={v.greedy_agree}/{v.greedy_tokens}",
                        flush=True,
                    )
    print(f"\nmodel={folder} dtype={args.dtype} threads={args.threads} seeds={args.seeds}")
    for size in args.sizes:
        for kind in args.sets:
            table([r for r in rows if r.size == size and r.kind == kind], names, f"{kind}, ~{size} tokens")
        table([r for r in rows if r.size == size], names, f"all sets, ~{size} tokens")


if __name__ == "__main__":
    main()
