"""What the benchmark scripts share: the model options and loading the model they name."""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kvchat.engine.forward_cache import cache_argument
from kvchat.models.packaged import ensure_converted

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Qwen2.5-3B's shapes, for a random-weight model: noise as text, real speed
QWEN25_3B = dict(
    hidden_size=2048,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=2,
    intermediate_size=11008,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
)


def machine() -> str:
    """The CPU a run's figures come from, in one line: rates differ between machine classes (one core
    of the AMD EPYC read 20-30 GB/s, one of the Intel Xeon 9-13), so every run names its own."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    names = [line.partition(":")[2].strip() for line in lines if line.startswith("model name")]
    cpu = names[0] if names else platform.processor() or "an unknown CPU"
    flags = next((set(line.split()) for line in lines if line.startswith("flags")), set())
    features = ", ".join(flag for flag in ("avx512_vnni", "avx512_bf16", "amx_int8") if flag in flags)
    return f"machine: {cpu} ({features or 'no AVX-512'}), {os.cpu_count()} CPUs, torch {torch.__version__}"


def model_parser(doc: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local model folder (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    return parser


def load(args: argparse.Namespace):
    """(folder, model, tokenizer) for the parsed options; sets the thread count."""
    torch.set_num_threads(args.threads)
    print(machine())
    folder = args.model or ensure_converted()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[args.dtype], attn_implementation="sdpa")
    return folder, model.eval(), AutoTokenizer.from_pretrained(folder)


# "What is the capital of France?" as a user turn in SmolLM2's chat template, with the assistant turn opened.
PROMPT_IDS = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


@torch.inference_mode()
def decode_tokens_per_s(model: torch.nn.Module, num_tokens: int) -> float:
    """Greedy decode rate of a transformers model after prefilling PROMPT_IDS, timed from the first step."""
    cache = DynamicCache(config=model.config)
    input_ids = torch.tensor([PROMPT_IDS])  # (1, T)
    logits = model(input_ids=input_ids, **cache_argument(model, cache), use_cache=True).logits  # (1, T, V)
    next_id = logits[:, -1:].argmax(-1)  # (1, 1)
    start = time.perf_counter()
    for _ in range(num_tokens):
        logits = model(input_ids=next_id, **cache_argument(model, cache), use_cache=True).logits  # (1, 1, V)
        next_id = logits[:, -1:].argmax(-1)
    return num_tokens / (time.perf_counter() - start)
