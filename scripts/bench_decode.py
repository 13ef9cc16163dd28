"""Decode speed, side by side in one run: kvchat's paged loop with its lean decode step and with the
module forward, and transformers' model.generate, on the same model, dtype, threads and prompt. (The
lean engine tiles the model's bf16 linears in place for kvchat's kernel, so once it exists the other
variants run on the tiled linears too: the rows compare the decode loops, not the weight layout.)

    python scripts/bench_decode.py --dtype bf16 --contexts 512 4096 --tokens 64 --repeats 5

Each variant prefills the prompt once, then decodes `--tokens` greedy tokens from that same prefix,
`--repeats` times, the variants taking turns; the table shows the median decode tokens/s and the
median of each run's ratio to the model.generate run beside it.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch
from bench_common import load, model_parser
from transformers import DynamicCache

from kvchat.engine.detokenizer import StreamDetokenizer
from kvchat.engine.engine import Engine
from kvchat.engine.forward_cache import cache_argument
from kvchat.engine.generate import generate
from kvchat.engine.sampling import SamplingParams


def prompt_of(tokenizer, num_tokens: int) -> list[int]:
    text = "The lighthouse keeper wrote in his log about the storm, the ships and the sea. " * 2000
    return tokenizer.encode(text)[:num_tokens]


def generate_runner(model, prompt: list[int], tokens: int) -> Callable[[], float]:
    """One run: model.generate's decode tokens/s from a prefilled copy of the prompt's cache."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt[:-1]]), **cache_argument(model, cache), use_cache=True)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.do_sample = None, False

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                torch.tensor([prompt]),
                past_key_values=copy.deepcopy(cache),
                generation_config=config,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )
        return time.perf_counter() - start

    return lambda: tokens / (timed(tokens + 1) - timed(1))  # the difference is the decode of `tokens`


def kvchat_runner(model, tokenizer, prompt: list[int], tokens: int, lean: bool = True) -> Callable[[], float]:
    """One run: kvchat's decode tokens/s after the same prefix, prefilled once."""
    engine = Engine(model, kv_memory_bytes=1 << 30, block_size=16, prefill_chunk=512, lean_decode=lean)
    seq = engine.start(prompt)
    engine.compute(seq, until=len(prompt) - 1)
    params = SamplingParams(max_tokens=tokens + 1)

    def run() -> float:
        run_seq = engine.start(prompt)  # shares the prefix blocks, computes the last token
        steps = list(generate(engine, run_seq, params, frozenset(), StreamDetokenizer(tokenizer)))
        engine.free(run_seq)
        return steps[-1].stats.decode_tok_s

    return run


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    folder, model, tokenizer = load(args)
    print(f"model={folder} dtype={args.dtype} threads={args.threads} tokens={args.tokens} x{args.repeats}")
    print("| context | variant | median tok/s | min | max | vs model.generate (median of paired ratios) |")
    print("|---:|---|---:|---:|---:|---:|")
    for context in args.contexts:
        prompt = prompt_of(tokenizer, context)
        runners = {
            "model.generate": generate_runner(model, prompt, args.tokens),
            "kvchat, module forward": kvchat_runner(model, tokenizer, prompt, args.tokens, lean=False),
            "kvchat": kvchat_runner(model, tokenizer, prompt, args.tokens),
        }
        rates: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.repeats):  # interleaved, so the machine's drift falls on every variant alike
            for name, run in runners.items():
                rates[name].append(run())
        base = rates["model.generate"]
        for name, rs in rates.items():
            ratio = statistics.median(r / b for r, b in zip(rs, base, strict=True))
            med = statistics.median(rs)
            print(f"| {context} | {name} | {med:.1f} | {min(rs):.1f} | {max(rs):.1f} | {ratio:.2f}x")


if __name__ == "__main__":
    main()
