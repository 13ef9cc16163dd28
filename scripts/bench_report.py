"""The benchmark results as Markdown, from the JSON files `bench_peer.py --json` writes (docs/results/):
the README's one table and docs/benchmarks.md's tables. Each part (decode, big) comes from the newest
file that has it. Used by make_docs.py."""

from __future__ import annotations

import json
import statistics
import textwrap
from pathlib import Path

# llama.cpp's type of the same bytes as each kvchat kind, the first one a run has: a GGUF's Q4_1 values
# run as they are under int4 (SmolLM2), int4 quantized anew takes 4.5 bits a weight as Q4_K (the 3B shapes)
PEERS = {
    "kvchat-bf16": ("llama-BF16",),
    "kvchat-bf16-int8": ("llama-Q8_0",),
    "kvchat-bf16-int4": ("llama-Q4_K", "llama-Q4_1"),
    "kvchat-bf16-int4-g128": ("llama-Q4_K", "llama-Q4_1"),
}
KINDS = {"kvchat-bf16": "bf16", "kvchat-bf16-int8": "int8", "kvchat-bf16-int4": "int4"}
MODELS = {"decode": "SmolLM2-135M (packaged)", "big": "Qwen2.5-3B's shapes (random weights)"}


def load_results(folder: Path) -> list[dict]:
    """Every results file in `folder`, oldest first."""
    runs = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(folder.glob("*.json"))]
    return sorted(runs, key=lambda run: run["date"])


def latest(runs: list[dict], part: str) -> dict | None:
    return next((run for run in reversed(runs) if run.get(part)), None)


def ratio(mine: list[float], theirs: list[float]) -> float:
    """The median of the paired ratios (repeats taking turns); of the medians when not paired."""
    if len(mine) == len(theirs):
        return statistics.median(a / b for a, b in zip(mine, theirs, strict=True))
    return statistics.median(mine) / statistics.median(theirs)


def peer_of(variant: str, present: set[str]) -> str | None:
    return next((p for p in PEERS.get(variant, ()) if p in present), None)


def _groups(run: dict, part: str) -> dict[int, list[dict]]:
    """The part's records by context length."""
    groups: dict[int, list[dict]] = {}
    for record in run[part]:
        groups.setdefault(record["context"], []).append(record)
    return groups


def _ratios(records: list[dict], variant: str) -> tuple[str, list[float]] | None:
    """(peer, its ratios over the prompts) for one kvchat variant among one context's records."""
    by_prompt: dict[str, dict[str, list[float]]] = {}
    for r in records:
        by_prompt.setdefault(r.get("prompt", ""), {})[r["variant"]] = r["tok_s"]
    present = {r["variant"] for r in records}
    peer = peer_of(variant, present)
    if variant not in present or peer is None:
        return None
    return peer, [ratio(rates[variant], rates[peer]) for rates in by_prompt.values() if variant in rates]


def _span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"


def readme_table(runs: list[dict]) -> str:
    """One table: kvchat's decode speed over llama.cpp's on the same weights, per model and context."""
    parts = [(part, run) for part in ("decode", "big") if (run := latest(runs, part)) is not None]
    kinds = [k for k in KINDS if any(_has(run, part, k) for part, run in parts)]
    lines = [
        "| model | context | " + " | ".join(f"kvchat {KINDS[k]}" for k in kinds) + " |",
        "|---|---:|" + "---:|" * len(kinds),
    ]
    for part, run in parts:
        for context, records in sorted(_groups(run, part).items()):
            cells = []
            for kind in kinds:
                found = _ratios(records, kind)
                cells.append(f"{_span(found[1])} {found[0].removeprefix('llama-')}" if found else "")
            lines.append(f"| {MODELS[part]} | {context:,} tokens | " + " | ".join(cells) + " |")
    dates = sorted({run["date"] for _, run in parts})
    machines = sorted({run["machine"].split(" (")[0] for _, run in parts})
    note = (
        f"kvchat's decode speed over llama.cpp's on the same weights (llama.cpp's type named; above 1 is "
        f"faster), one thread, greedy; measured {', '.join(dates)} on a 2-vCPU {', '.join(machines)}. "
        "Method and every figure: [docs/benchmarks.md](docs/benchmarks.md)."
    )
    return "\n".join([*lines, "", textwrap.fill(note, width=104)])


def _has(run: dict, part: str, variant: str) -> bool:
    return any(r["variant"] == variant for r in run[part])


def results_section(runs: list[dict]) -> str:
    """docs/benchmarks.md's results: each part's newest run, every variant's rate and ratio."""
    out = []
    for part in ("decode", "big"):
        run = latest(runs, part)
        if run is None:
            continue
        bandwidth = ", ".join(f"{b:.1f}" for b in run.get("bandwidth_gb_s", []))
        out += [
            f"### {MODELS[part]}",
            "",
            f"Measured {run['date']} on {run['machine']}"
            + (f"; one-thread read bandwidth {bandwidth} GB/s (start, end)" if bandwidth else "")
            + f". `{run['command']}`"
            + (f" ({run['note']})" if run.get("note") else "")
            + ".",
            "",
            "| context | prompt | variant | tok/s | vs llama.cpp, same bytes |",
            "|---:|---|---|---:|---:|",
        ]
        for context, records in sorted(_groups(run, part).items()):
            present = {r["variant"] for r in records}
            for r in records:
                peer = peer_of(r["variant"], present)
                rates = {x["variant"]: x["tok_s"] for x in records if x.get("prompt") == r.get("prompt")}
                versus = f"{ratio(r['tok_s'], rates[peer]):.2f}x {peer}" if peer in rates else ""
                median = statistics.median(r["tok_s"])
                prompt = r.get("prompt", "")
                out.append(f"| {context:,} | {prompt} | {r['variant']} | {median:.2f} | {versus} |")
        out.append("")
    return "\n".join(out).rstrip("\n")
