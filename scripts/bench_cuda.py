"""Decode on a CUDA GPU, side by side in one run: kvchat's paged loop (the module forward over its pool)
and transformers' own cache loop, on a random-weight model with Qwen2.5-3B's shapes in bf16, int8 and
int4 (torch's weight-only kernels), the variants taking turns; and the GPU's copy bandwidth, measured
in the same run.

    python scripts/bench_cuda.py --contexts 512 4096 --tokens 64 --repeats 3

Each variant prefills its context once; every run decodes `--tokens` greedy tokens after it. tok/s are
medians; "weights GB/s" is the weights a token reads times tok/s, against the copy bandwidth above.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from peer_runners import KvchatRunner, make_big_model, model_bytes
from transformers import DynamicCache

from kvchat.engine.forward_cache import cache_argument

KINDS = ("bf16", "bf16-int8", "bf16-int4")


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """GB/s of a device-to-device copy, counting the bytes read and written."""
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        target.copy_(source)
    end.record()
    torch.cuda.synchronize()
    return 2 * 10 * nbytes / (start.elapsed_time(end) / 1e3) / 1e9


def transformers_runner(model, prompt: list[int], tokens: int) -> Callable[[], float]:
    """One run: greedy decode tok/s of the model's own forward and DynamicCache, from a copy of the
    prompt's prefilled cache."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(
            input_ids=torch.tensor([prompt[:-1]], device="cuda"),
            **cache_argument(model, cache),
            use_cache=True,
        )

    @torch.inference_mode()
    def run() -> float:
        run_cache = copy.deepcopy(cache)
        next_id = torch.tensor([[prompt[-1]]], device="cuda")
        logits = model(input_ids=next_id, **cache_argument(model, run_cache), use_cache=True).logits
        next_id = logits[:, -1:].argmax(-1)  # (1, 1)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(tokens):
            logits = model(input_ids=next_id, **cache_argument(model, run_cache), use_cache=True).logits
            next_id = logits[:, -1:].argmax(-1)
            int(next_id)  # as a chat does: each token is read before the next step
        return tokens / (time.perf_counter() - start)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ttft-tokens", type=int, default=2000)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="bf16 always runs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda.py needs a CUDA GPU")
    print(f"machine: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth: {bandwidth:.0f} GB/s (bytes read and written)")
    kinds = [kind for kind in KINDS if kind == "bf16" or kind in args.kinds]
    models = {kind: make_big_model(kind, device="cuda") for kind in kinds}
    kvchat = {kind: KvchatRunner(model, None, False) for kind, model in models.items()}
    print("| context | variant | tok/s (median) | range | weights GB/s | vs transformers, bf16 |")
    print("|---:|---|---:|---:|---:|---:|")
    for context in args.contexts:
        prompt = [1000 + (i * 7919) % 140000 for i in range(context)]
        runners: dict[str, Callable[[], float]] = {}
        for kind in kinds:
            runners[f"transformers {kind}"] = transformers_runner(models[kind], prompt, args.tokens)
            runners[f"kvchat {kind}"] = lambda k=kind, p=prompt: kvchat[k].decode(p, args.tokens + 1)
        for run in runners.values():
            run()  # warm: the first run builds kernels and fills the prefix
        rates: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.repeats):
            for name, run in runners.items():
                rates[name].append(run())
        base = statistics.median(rates["transformers bf16"])
        for name, rs in rates.items():
            median = statistics.median(rs)
            gb_s = median * model_bytes(models[name.split()[1]]) / 1e9
            print(
                f"| {context} | {name} | {median:.1f} | {min(rs):.1f}-{max(rs):.1f} | {gb_s:.0f} | "
                f"{median / base:.2f}x |"
            )
    if args.ttft_tokens:
        long_prompt = [2000 + (i * 7919) % 140000 for i in range(args.ttft_tokens)]
        print(f"\ncold TTFT over {args.ttft_tokens} tokens, kvchat, median of {args.repeats}:")
        for kind, runner in kvchat.items():
            times = [runner.ttft_cold(long_prompt) for _ in range(args.repeats)]
            print(f"  {kind}: {statistics.median(times) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
