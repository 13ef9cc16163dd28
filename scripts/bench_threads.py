"""Decode speed of the packaged SmolLM2 in kvchat's engine per dtype and thread count, the thread counts
taking turns; feeds the rule in kvchat.models.device.

Run: python scripts/bench_threads.py [--tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from bench_common import machine
from peer_runners import KvchatRunner, make_kvchat_models
from transformers import AutoTokenizer

from kvchat.models.packaged import ensure_converted

REQUEST = "Write a new story about a baker who finds a map inside a loaf of bread."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(machine())
    folder = ensure_converted()
    num_cpus = len(os.sched_getaffinity(0))
    print(f"torch {torch.__version__}, {num_cpus} CPUs, torch default threads {torch.get_num_threads()}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": REQUEST}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    for name, model in make_kvchat_models(folder, ["kvchat-bf16", "kvchat-fp32"]).items():
        runner = KvchatRunner(model, tokenizer, speculate=False)
        runner.decode(prompt, 2)  # warm-up: kernels, the prompt's KV
        rates: dict[int, list[float]] = {threads: [] for threads in range(1, num_cpus + 1)}
        for _ in range(args.repeats):
            for threads, runs in rates.items():
                torch.set_num_threads(threads)
                runs.append(runner.decode(prompt, args.tokens))
        for threads, runs in rates.items():
            runs_text = ", ".join(f"{r:.1f}" for r in runs)
            median = statistics.median(runs)
            ratio = median / statistics.median(rates[1])
            print(f"{name:12} threads={threads}: median {median:6.1f} tok/s ({runs_text}), {ratio:.2f}x")


if __name__ == "__main__":
    main()
