"""Decode speed of the packaged SmolLM2 per dtype and thread count; feeds the rule in kvchat.models.device.

Run: python scripts/bench_threads.py [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from kvchat.models.packaged import ensure_converted

PROMPT_IDS = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


@torch.inference_mode()
def decode_tokens_per_s(model: AutoModelForCausalLM, num_tokens: int) -> float:
    cache = DynamicCache()
    input_ids = torch.tensor([PROMPT_IDS])  # (1, T)
    logits = model(input_ids=input_ids, past_key_values=cache, use_cache=True).logits  # (1, T, V)
    next_id = logits[:, -1:].argmax(-1)  # (1, 1)
    start = time.perf_counter()
    for _ in range(num_tokens):
        logits = model(input_ids=next_id, past_key_values=cache, use_cache=True).logits  # (1, 1, V)
        next_id = logits[:, -1:].argmax(-1)
    return num_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    folder = ensure_converted()
    num_cpus = len(os.sched_getaffinity(0))
    print(f"torch {torch.__version__}, {num_cpus} CPUs, torch default threads {torch.get_num_threads()}")
    for dtype in (torch.bfloat16, torch.float32):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        for threads in range(1, num_cpus + 1):
            torch.set_num_threads(threads)
            decode_tokens_per_s(model, 8)  # warm-up: kernels, caches
            runs = [decode_tokens_per_s(model, args.tokens) for _ in range(args.repeats)]
            runs_text = ", ".join(f"{r:.1f}" for r in runs)
            median = statistics.median(runs)
            print(f"{str(dtype):15} threads={threads}: median {median:6.1f} tok/s  ({runs_text})")


if __name__ == "__main__":
    main()
