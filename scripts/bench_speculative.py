"""Speculative decoding, side by side in one run: decode speed without drafts, with prompt-lookup drafts,
and (with --draft-model) with a draft model's drafts, on answers that copy the context and on free writing.

    python scripts/bench_speculative.py --dtype bf16 --threads 1 --tokens 128 --repeats 3

Each prompt is prefilled once per variant; each run decodes greedy tokens from that prefix until the
model's end of turn or `--tokens`, the variants taking turns. The table shows the median decode
tokens/s, the median of each run's ratio to the run without drafts beside it, the share of drafted
tokens accepted, and whether the greedy text equals the text without drafts (in fp32 it must; in bf16
a forward over several tokens rounds differently from a forward over one, so a near tie between two
tokens can go the other way).

First it measures what a forward over the last token and k drafts costs in single-token steps (the median
of 7 rounds after ~50 tokens of context), beside `Engine.verify_cost`, the figure the draft budget weighs
a step's tokens against.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from bench_common import DTYPES, load, model_parser
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvchat.engine.detokenizer import StreamDetokenizer
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate
from kvchat.engine.records import GenerationStep
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.speculate import Speculation
from kvchat.models.loader import eos_token_ids

PASSAGE = (
    "The lighthouse stood on a rock at the mouth of the bay. Every evening at dusk the keeper climbed the "
    "one hundred and twelve steps, trimmed the wick, polished the great lens and lit the lamp. Ships far "
    "out at sea saw its beam sweep across the water every ten seconds, and they knew where the reef lay. "
    "In winter the storms came from the north, and the waves broke so high that spray reached the gallery."
)
ANSWER = (
    "To make a good cup of tea, boil fresh water and warm the pot first. Add one spoon of tea leaves per "
    "cup, pour the water over them just off the boil, and let it steep for three to five minutes. Strain "
    "it into a cup, and add milk or lemon if you like. Black teas take hotter water than green teas do."
)
CODE = """def summarize(values):
    total = 0
    count = 0
    for x in values:
        if x is None:
            continue
        total += x
        count += 1
    mean = total / count if count else 0.0
    return {"total": total, "count": count, "mean": mean}
"""
PROMPTS = {
    "copy": {
        "repeat a passage": f"Repeat the following passage word for word.\n\n{PASSAGE}",
        "quote and explain": f"{PASSAGE}\n\nQuote the first two sentences, then explain them.",
        "rewrite an answer": f"Here is an earlier answer:\n\n{ANSWER}\n\nRewrite it with numbered steps.",
        "edit code": f"```python\n{CODE}```\n\nRename the variable `x` to `value`; show the whole function.",
    },
    "free": {
        "story": "Write a short story about a fox who learns to sail.",
        "explain": "Explain how a refrigerator keeps food cold.",
        "ideas": "Give me ten ideas for a rainy afternoon with children.",
        "letter": "Write a letter to a friend about your new job at a bakery.",
    },
}


def runner(model, tokenizer, prompt: list[int], tokens: int, speculation: Speculation | None) -> Callable:
    """One run: (decode tokens/s, drafted, accepted, text) after the prompt, prefilled once."""
    eos = eos_token_ids(model, tokenizer)
    engine = Engine(model, kv_memory_bytes=1 << 30, block_size=16, prefill_chunk=512)
    seq = engine.start(prompt)
    engine.compute(seq, until=len(prompt) - 1)
    engine.free(seq)
    params = SamplingParams(max_tokens=tokens)

    def run() -> tuple[float, int, int, str]:
        run_seq = engine.start(prompt)  # shares the prefix blocks, computes the last token
        detokenizer = StreamDetokenizer(tokenizer)
        steps = [s for s in generate(engine, run_seq, params, eos, detokenizer, speculation)]
        engine.free(run_seq)
        last = steps[-1]
        assert isinstance(last, GenerationStep)
        text = "".join(s.text for s in steps if isinstance(s, GenerationStep))
        return last.stats.decode_tok_s, last.stats.drafted_tokens, last.stats.accepted_tokens, text

    return run


@torch.inference_mode()
def print_verify_costs(model, rounds: int = 7) -> None:
    engine = Engine(model, kv_memory_bytes=1 << 28, block_size=16, prefill_chunk=512)
    seq = engine.start([100 + 7 * i for i in range(52)], reuse=False)
    engine.compute(seq, until=51)
    last = seq.token_ids[-1]
    times: dict[int, list[float]] = {k: [] for k in (0, 1, 2, 4, 8)}
    for _ in range(rounds):
        for k, spent in times.items():
            engine.extend(seq, [11] * k)
            start = time.perf_counter()
            engine.compute(seq, all_logits=k > 0, record=False)
            spent.append(time.perf_counter() - start)
            engine.truncate(seq, 51)  # back to 51 tokens with KV and the last one without
            engine.extend(seq, [last])
    engine.free(seq)
    one = statistics.median(times[0])
    print(f"\none token: {one * 1e3:.1f} ms on the {engine.decode_path}")
    print("| drafts | verification, measured (single-token steps) | Engine.verify_cost |")
    print("|---:|---:|---:|")
    for k in (1, 2, 4, 8):
        print(f"| {k} | {statistics.median(times[k]) / one:.2f} | {engine.verify_cost(k, 52):.2f} |")
    print()


def draft_engine(args, tokenizer) -> Engine | None:
    if not args.draft_model:
        return None
    draft_tokenizer = AutoTokenizer.from_pretrained(args.draft_model)
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise SystemExit(f"{args.draft_model} does not share the model's tokenizer")
    model = AutoModelForCausalLM.from_pretrained(
        args.draft_model, dtype=DTYPES[args.dtype], attn_implementation="sdpa"
    ).eval()
    return Engine(model, kv_memory_bytes=1 << 30, block_size=16, prefill_chunk=512)


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--draft-model", help="a local model folder sharing the tokenizer, to draft with")
    parser.add_argument("--draft-max", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    folder, model, tokenizer = load(args)
    variants: dict[str, Speculation | None] = {
        "off": None,
        "prompt-lookup": Speculation("prompt-lookup", args.draft_max),
    }
    drafts = draft_engine(args, tokenizer)
    if drafts is not None:
        variants["draft"] = Speculation("draft", args.draft_max, drafts)
    print(f"model={folder} dtype={args.dtype} threads={args.threads} tokens={args.tokens} x{args.repeats}")
    print_verify_costs(model)
    header = (
        "| set | prompt | variant | median tok/s | vs off (median of paired ratios) | accepted | same text |"
    )
    print(header)
    print("|---|---|---|---:|---:|---:|---|")
    summary: dict[tuple[str, str], list[float]] = {}
    for kind, prompts in PROMPTS.items():
        for name, text in prompts.items():
            messages = [{"role": "user", "content": text}]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
            runs = {v: runner(model, tokenizer, prompt, args.tokens, s) for v, s in variants.items()}
            results: dict[str, list[tuple[float, int, int, str]]] = {v: [] for v in runs}
            for run in runs.values():
                run()  # warm-up, untimed
            for _ in range(args.repeats):  # interleaved, so the machine's drift falls on every variant alike
                for v, run in runs.items():
                    results[v].append(run())
            base = results["off"]
            for v, rs in results.items():
                ratio = statistics.median(r[0] / b[0] for r, b in zip(rs, base, strict=True))
                summary.setdefault((kind, v), []).append(ratio)
                drafted, accepted = rs[-1][1], rs[-1][2]
                share = f"{accepted / drafted:.0%} of {drafted}" if drafted else "-"
                same = all(r[3] == base[0][3] for r in rs)
                med = statistics.median(r[0] for r in rs)
                same_text = "yes" if same else "NO"
                print(f"| {kind} | {name} | {v} | {med:.1f} | {ratio:.2f}x | {share} | {same_text} |")
    print()
    print("| set | variant | median over prompts of the paired ratio vs off |")
    print("|---|---|---:|")
    for (kind, v), ratios in summary.items():
        print(f"| {kind} | {v} | {statistics.median(ratios):.2f}x |")


if __name__ == "__main__":
    main()
