"""kvchat against llama.cpp (llama-cpp-python, the `bench` extra) on the packaged SmolLM2-135M, side by
side in one run, one thread, greedy, the variants taking turns:

    python scripts/bench_peer.py                      # every part, ~12 minutes on a quiet machine
    python scripts/bench_peer.py --parts decode --contexts 50 --variants kvchat-bf16 llama-BF16

`--json FILE` also writes every measurement (each repeat's rate) to FILE, which
scripts/make_docs.py turns into docs/benchmarks.md's results and the README's table.

Variants: kvchat-<bf16|fp32>[-int8|-int4|-int4-g128][-spec] (a quantized kind needs
kvchat.models.quantize; -spec drafts by prompt lookup; for big, kvchat-bf16-int4-head-int8 too: the
output layer int8, not rescored) and llama-<BF16|Q8_0|Q4_1> (GGUF files of the packaged weights,
scripts/peer_gguf.py; for big, llama-Q4_K too). Parts: decode (tok/s and weight GB/s after ~50 and
~4,000 tokens of context, a free-writing and a copying prompt), ttft (cold, ~2,000 tokens; turn 2
reusing the first turn), bandwidth (one-thread read of 256 MB), big (a random-weight model shaped as
Qwen2.5-3B: kvchat's bf16 and the quantized kinds asked for, and llama.cpp's types asked for, on GGUF
files of the same weights, written once: ~2 minutes and 11 GB of disk for BF16, Q8_0 and Q4_1; Q4_K is
made from BF16 by llama.cpp, 1.9 GB more), big-turns (kvchat's kinds alone on that model, held in memory
together, decoding a token each in turn, `--repeats` windows of `--big-tokens` tokens: the median of
each kind's ratios to bf16 window by window, which the machine's drift moves least; ~13 GB of memory for
bf16, int8, int4 and int4-g128; `--big-ttft-tokens N` adds each kind's cold TTFT over N tokens, in
rounds in turn).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time

import torch
from bench_common import machine
from peer_gguf import big_path, packaged_as
from peer_runners import (
    KvchatRunner,
    LlamaRunner,
    Runner,
    make_big_model,
    make_kvchat_models,
    write_big_files,
)
from transformers import AutoTokenizer

from kvchat.models.packaged import ensure_converted

PASSAGE = (
    "The lighthouse keeper wrote in his log each night: the wind from the west, the lamp trimmed at "
    "dusk, two fishing boats in before the storm, a gull asleep on the rail, the tide turning at nine. "
)
FREE = "Write a new story about a baker who finds a map inside a loaf of bread."
COPY = "Copy the last paragraph of the log above, word for word."
PARTS = ("bandwidth", "decode", "ttft", "big", "big-turns")
DEFAULT_VARIANTS = [
    "kvchat-bf16",
    "kvchat-fp32",
    "kvchat-bf16-spec",
    "kvchat-fp32-spec",
    "llama-BF16",
    "llama-Q8_0",
    "llama-Q4_1",
]
# What --json writes: each part's measurements as they are taken.
RESULTS: dict[str, list[dict]] = {"decode": [], "ttft": [], "big": [], "bandwidth_gb_s": []}


def chat_ids(tokenizer, messages: list[dict[str, str]], generation_prompt: bool = True) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
        )
    )


def passage_prompt(tokenizer, num_tokens: int, request: str) -> list[int]:
    """A chat prompt of about `num_tokens`: a log of repeated lines, then the request."""
    budget = max(0, num_tokens - len(chat_ids(tokenizer, [{"role": "user", "content": request}])))
    words = tokenizer.decode(tokenizer.encode(PASSAGE * (1 + budget // 30))[:budget])
    return chat_ids(tokenizer, [{"role": "user", "content": f"{words}\n\n{request}"}])


def read_bandwidth() -> float:
    """GB/s of a one-thread sum over a 256 MB fp32 tensor (median of five)."""
    data = torch.ones(64 << 20)
    rates = []
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        rates.append(data.nbytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def make_runners(names: list[str], tokenizer) -> dict[str, Runner]:
    models = make_kvchat_models(ensure_converted(), [n for n in names if n.startswith("kvchat-")])
    runners: dict[str, Runner] = {}
    for name in names:
        if name.startswith("llama-"):
            runners[name] = LlamaRunner(packaged_as(name.removeprefix("llama-")))
        else:
            key = name.removesuffix("-spec")
            runners[name] = KvchatRunner(models[key], tokenizer, name.endswith("-spec"))
    return runners


def table(title: str, header: str, rows: list[str]) -> None:
    print(f"\n{title}\n\n{header}")
    print("|" + "|".join(["---"] + ["---:"] * (header.count("|") - 2)) + "|")
    for row in rows:
        print(row)


def run_decode(runners: dict[str, Runner], tokenizer, args) -> None:
    rows = []
    for context in args.contexts:
        for kind, request in (("free", FREE), ("copy", COPY)):
            prompt = passage_prompt(tokenizer, context, request)
            for runner in runners.values():  # prefill once, outside the timing
                runner.decode(prompt, 2)
            rates: dict[str, list[float]] = {name: [] for name in runners}
            for _ in range(args.repeats):
                for name, runner in runners.items():
                    rates[name].append(runner.decode(prompt, args.tokens))
            for name, rs in rates.items():
                record = {"context": len(prompt), "prompt": kind, "variant": name, "tok_s": rs}
                RESULTS["decode"].append(record)
            base = rates.get(args.baseline)
            for name, rs in rates.items():
                ratio = statistics.median(r / b for r, b in zip(rs, base, strict=True)) if base else 0
                rate = statistics.median(rs)
                gbs = rate * runners[name].weight_bytes / 1e9
                rows.append(f"| {len(prompt)} | {kind} | {name} | {rate:.1f} | {gbs:.1f} | {ratio:.2f}x |")
    table(
        f"Decode, {args.tokens} greedy tokens, median of {args.repeats} (ratio: paired, to {args.baseline})",
        "| context | prompt | variant | tok/s | weights GB/s | ratio |",
        rows,
    )


def run_ttft(runners: dict[str, Runner], tokenizer, args) -> None:
    timed = {name: runner for name, runner in runners.items() if not name.endswith("-spec")}
    first = [{"role": "user", "content": tokenizer.decode(passage_prompt(tokenizer, args.ttft_tokens, FREE))}]
    first_ids = chat_ids(tokenizer, first)
    answered = [*first, {"role": "assistant", "content": "Once upon a time there was a baker named Rosa."}]
    second = [*answered, {"role": "user", "content": "Now give her a brother who is a sailor."}]
    turn1_ids, turn2_ids = chat_ids(tokenizer, answered, generation_prompt=False), chat_ids(tokenizer, second)
    cold: dict[str, list[float]] = {name: [] for name in timed}
    warm: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(args.repeats):
        for name, runner in timed.items():
            cold[name].append(runner.ttft_cold(first_ids))
            warm[name].append(runner.ttft_turn2(turn1_ids, turn2_ids))
    for name in timed:
        times = {"cold_s": cold[name], "turn2_s": warm[name]}
        RESULTS["ttft"].append({"variant": name, "tokens": len(first_ids), **times})
    rows = [
        f"| {name} | {statistics.median(cold[name]):.2f} | {statistics.median(warm[name]):.3f} |"
        for name in timed
    ]
    table(
        f"TTFT (s): cold over {len(first_ids)} tokens; turn 2 over {len(turn2_ids)}, "
        f"{len(turn2_ids) - len(turn1_ids)} past the first turn",
        "| variant | cold | turn 2 |",
        rows,
    )


BIG_KINDS = ("bf16", "bf16-int8", "bf16-int4", "bf16-int4-head-int8", "bf16-int4-g128")
# llama.cpp's type of a kind's bytes: int4 quantized anew nests its scales, 4.5 bits a weight as Q4_K
# (Q4_1: 5, as int4 on a Q4_1 file's own values); int4's rescored output layer reads 0.14 GB a 3B token
# less than Q4_K's Q8_0 one
SAME_BYTES = {"bf16": "BF16", "bf16-int8": "Q8_0", "bf16-int4": "Q4_K"}
BIG_TYPES = ("BF16", "Q8_0", "Q4_1", "Q4_K")


def run_big(args) -> None:
    """kvchat and llama.cpp on one random-weight model with Qwen2.5-3B's shapes (seeded: the same
    weights in both), each llama.cpp type measured right after the kvchat kind of its bytes."""
    kinds = [k for k in BIG_KINDS if k == "bf16" or f"kvchat-{k}" in args.variants]
    types = [t for t in BIG_TYPES if f"llama-{t}" in args.variants]
    write_big_files(types)
    order = []
    for kind in kinds:
        order.append(f"kvchat-{kind}")
        if SAME_BYTES.get(kind) in types:
            order.append(f"llama-{SAME_BYTES[kind]}")
    order += [f"llama-{t}" for t in types if f"llama-{t}" not in order]
    prompt = list(range(1000, 1050))
    rates, bytes_read = {}, {}
    for name in order:
        if name.startswith("llama-"):
            runner = LlamaRunner(big_path(name.removeprefix("llama-")))
        else:
            runner = KvchatRunner(make_big_model(name.removeprefix("kvchat-")), None, False)
        runner.decode(prompt, 2)
        runs = [runner.decode(prompt, args.big_tokens) for _ in range(args.repeats)]
        RESULTS["big"].append({"context": len(prompt), "variant": name, "tok_s": runs})
        rates[name] = statistics.median(runs)
        bytes_read[name] = runner.weight_bytes
        del runner
        gc.collect()
    rows = []
    for name in order:
        engine_bf16 = "llama-BF16" if name.startswith("llama-") else "kvchat-bf16"
        own = f"{rates[name] / rates[engine_bf16]:.2f}x" if engine_bf16 in rates else ""
        peer = f"llama-{SAME_BYTES.get(name.removeprefix('kvchat-'))}"
        beside = f"{rates[name] / rates[peer]:.2f}x" if name.startswith("kvchat-") and peer in rates else ""
        gb_s = rates[name] * bytes_read[name] / 1e9
        rows.append(f"| {name} | {rates[name]:.2f} | {gb_s:.1f} | {own} | {beside} |")
    table(
        f"Random-weight model with Qwen2.5-3B's shapes, ~50 tokens of context, {args.big_tokens} tokens, "
        f"median of {args.repeats}",
        "| variant | tok/s | weights GB/s | vs its engine's bf16 | vs llama.cpp, same bytes |",
        rows,
    )


def run_big_turns(args) -> None:
    """kvchat's kinds on the 3B-shaped model, a token each in turn: ratios to bf16 per window of
    `--big-tokens` tokens."""
    kinds = [k for k in BIG_KINDS if k == "bf16" or f"kvchat-{k}" in args.variants]
    runners = {kind: KvchatRunner(make_big_model(kind), None, False) for kind in kinds}
    prompt = list(range(1000, 1050))
    total = args.repeats * args.big_tokens
    streams = {kind: runner.tokens(prompt, total) for kind, runner in runners.items()}
    for stream in streams.values():
        next(stream)  # the prefill and the first token
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for token in range(total):
        for kind in kinds if token % 2 == 0 else kinds[::-1]:
            start = time.perf_counter()
            next(streams[kind])
            times[kind].append(time.perf_counter() - start)
    for stream in streams.values():
        stream.close()
    rows = []
    for kind in kinds:
        spans = [
            (sum(times["bf16"][i : i + args.big_tokens]), sum(times[kind][i : i + args.big_tokens]))
            for i in range(0, total, args.big_tokens)
        ]
        ratios = [base / took for base, took in spans]
        median = args.big_tokens / statistics.median(took for _, took in spans)
        gb_s = median * runners[kind].weight_bytes / 1e9
        rows.append(
            f"| kvchat-{kind} | {median:.2f} | {gb_s:.1f} | {statistics.median(ratios):.2f}x | "
            f"{min(ratios):.2f}-{max(ratios):.2f}x |"
        )
    table(
        f"kvchat on the Qwen2.5-3B-shaped model, the kinds taking turns a token each, {total} tokens "
        f"({args.repeats} windows of {args.big_tokens}), from ~50 tokens of context",
        "| variant | tok/s (median window) | weights GB/s | vs bf16 (median of windows) | range |",
        rows,
    )
    if args.big_ttft_tokens:
        long_prompt = list(range(1000, 1000 + args.big_ttft_tokens))
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(args.repeats):
            for kind, runner in runners.items():
                times[kind].append(runner.ttft_cold(long_prompt))
        table(
            f"Cold TTFT over {args.big_ttft_tokens} tokens, the kinds taking turns, {args.repeats} rounds",
            "| variant | seconds (median) | range |",
            [
                f"| kvchat-{k} | {statistics.median(t):.2f} | {min(t):.2f}-{max(t):.2f} |"
                for k, t in times.items()
            ],
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS[:-1]))  # not big-turns
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    parser.add_argument("--baseline", default="llama-BF16", help="the variant ratios are taken to")
    parser.add_argument("--contexts", type=int, nargs="+", default=[50, 4000])
    parser.add_argument("--tokens", type=int, default=24, help="decoded tokens per timed run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ttft-tokens", type=int, default=2000)
    parser.add_argument("--big-tokens", type=int, default=6)
    parser.add_argument(
        "--big-ttft-tokens", type=int, default=0, help="big-turns: a cold prefill too (0: none)"
    )
    parser.add_argument("--json", metavar="FILE", help="also write every measurement to FILE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine())
    tokenizer = AutoTokenizer.from_pretrained(ensure_converted())
    runners = make_runners(args.variants, tokenizer) if {"decode", "ttft"} & set(args.parts) else {}
    if "bandwidth" in args.parts:
        RESULTS["bandwidth_gb_s"].append(read_bandwidth())
        print(f"one-thread read bandwidth: {RESULTS['bandwidth_gb_s'][-1]:.1f} GB/s")
    if "decode" in args.parts:
        run_decode(runners, tokenizer, args)
    if "ttft" in args.parts:
        run_ttft(runners, tokenizer, args)
    if "bandwidth" in args.parts:
        RESULTS["bandwidth_gb_s"].append(read_bandwidth())
        print(f"\none-thread read bandwidth, again: {RESULTS['bandwidth_gb_s'][-1]:.1f} GB/s")
    if "big" in args.parts:
        run_big(args)
    if "big-turns" in args.parts:
        run_big_turns(args)
    if args.json:
        write_json(args.json)


def write_json(path: str) -> None:
    """The run's measurements, the machine and the day, as scripts/make_docs.py reads them."""
    record = {"date": datetime.date.today().isoformat(), "machine": machine().removeprefix("machine: ")}
    record["command"] = " ".join(["python", "scripts/bench_peer.py", *sys.argv[1:]])
    with open(path, "w", encoding="utf-8") as out:
        json.dump({**record, **RESULTS}, out, indent=1)
        out.write("\n")


if __name__ == "__main__":
    main()
