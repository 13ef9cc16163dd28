"""Decode speed of the packaged SmolLM2 per dtype and thread count; feeds the rule in kvchat.models.device.

Run: python scripts/bench_threads.py [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from bench_common import decode_tokens_per_s
from transformers import AutoModelForCausalLM

from kvchat.models.packaged import ensure_converted


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
