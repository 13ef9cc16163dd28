"""Decode speed, side by side in one run: kvchat's paged loop, kvchat with a contiguous cache, and
transformers' model.generate, on the same model, dtype, threads and prompt.

    python scripts/bench_decode.py --dtype bf16 --contexts 512 4096 --tokens 64 --repeats 5

Each variant prefills the prompt once, then decodes `--tokens` greedy tokens `--repeats` times from
that same prefix; the table shows the median decode tokens/s and its ratio to model.generate.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from bench_common import load, model_parser
from transformers import DynamicCache

from kvchat.engine.detokenizer import StreamDetokenizer
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate
from kvchat.engine.sampling import SamplingParams


def prompt_of(tokenizer, num_tokens: int) -> list[int]:
    text = "The lighthouse keeper wrote in his log about the storm, the ships and the sea. " * 2000
    return tokenizer.encode(text)[:num_tokens]


def bench_generate(model, prompt: list[int], tokens: int, repeats: int) -> list[float]:
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prompt[:-1]]), past_key_values=cache, use_cache=True)
        config = copy.deepcopy(model.generation_config)
        config.eos_token_id, config.do_sample = None, False
        rates = []
        for _ in range(repeats):
            for n in (1, tokens + 1):  # the difference is the decode of `tokens` tokens
                start = time.perf_counter()
                model.generate(
                    torch.tensor([prompt]),
                    past_key_values=copy.deepcopy(cache),
                    generation_config=config,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    pad_token_id=0,
                )
                elapsed = time.perf_counter() - start
                if n == 1:
                    first = elapsed
            rates.append(tokens / (elapsed - first))
    return rates


def bench_kvchat(model, tokenizer, prompt: list[int], tokens: int, repeats: int, paged: bool) -> list[float]:
    engine = Engine(model, kv_memory_bytes=1 << 30, block_size=16, prefill_chunk=512, paged=paged)
    seq = engine.start(prompt)
    engine.compute(seq, until=len(prompt) - 1)
    rates = []
    params = SamplingParams(max_tokens=tokens + 1)
    for _ in range(repeats):
        if paged:
            run = engine.start(prompt)  # shares the prefix blocks, computes the last token
        else:
            del seq.token_ids[len(prompt) :]  # the contiguous cache keeps the prefix rows
            seq.num_computed = len(prompt) - 1
            run = seq
        steps = list(generate(engine, run, params, frozenset(), StreamDetokenizer(tokenizer)))
        rates.append(steps[-1].stats.decode_tok_s)
        if paged:
            engine.free(run)
    return rates


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    folder, model, tokenizer = load(args)
    print(f"model={folder} dtype={args.dtype} threads={args.threads} tokens={args.tokens} x{args.repeats}")
    print("| context | variant | median tok/s | min | max | vs model.generate |")
    print("|---:|---|---:|---:|---:|---:|")
    for context in args.contexts:
        prompt = prompt_of(tokenizer, context)
        results = {
            "model.generate": bench_generate(model, prompt, args.tokens, args.repeats),
            "kvchat contiguous": bench_kvchat(
                model, tokenizer, prompt, args.tokens, args.repeats, paged=False
            ),
            "kvchat paged": bench_kvchat(model, tokenizer, prompt, args.tokens, args.repeats, paged=True),
        }
        base = statistics.median(results["model.generate"])
        for name, rates in results.items():
            med = statistics.median(rates)
            print(
                f"| {context} | {name} | {med:.1f} | {min(rates):.1f} | {max(rates):.1f} | {med / base:.2f}x"
            )


if __name__ == "__main__":
    main()
