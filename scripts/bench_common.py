"""What the benchmark scripts share: the model options and loading the model they name."""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvchat.models.packaged import ensure_converted

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def model_parser(doc: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local model folder (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    return parser


def load(args: argparse.Namespace):
    """(folder, model, tokenizer) for the parsed options; sets the thread count."""
    torch.set_num_threads(args.threads)
    folder = args.model or ensure_converted()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[args.dtype], attn_implementation="sdpa")
    return folder, model.eval(), AutoTokenizer.from_pretrained(folder)
