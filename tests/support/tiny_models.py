"""Tiny random-weight causal LMs built from configs: fast tests of the Llama, Qwen2 and Qwen3 code paths."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)

KINDS = ("llama", "qwen2", "qwen3")


def make_tiny_model(
    kind: str, vocab_size: int = 512, seed: int = 0, dtype=torch.float32, num_layers: int = 2
):
    """A random model of the given family, in eval mode, with SDPA attention."""
    torch.manual_seed(seed)
    common = {**_COMMON, "num_hidden_layers": num_layers}
    if kind == "llama":
        config = LlamaConfig(vocab_size=vocab_size, **common)
        cls = LlamaForCausalLM
    elif kind == "qwen2":
        config = Qwen2Config(vocab_size=vocab_size, **common)
        cls = Qwen2ForCausalLM
    elif kind == "qwen3":
        config = Qwen3Config(vocab_size=vocab_size, head_dim=16, **common)
        cls = Qwen3ForCausalLM
    else:
        raise ValueError(kind)
    config._attn_implementation = "sdpa"
    model = cls(config).to(dtype).eval()
    return model
