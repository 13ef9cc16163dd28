"""The model families kvchat runs, for tests: a tiny random-weight model built from each family's own
transformers config, a real tokenizer a package ships, and the family's real chat template
(tests/fixtures/templates). Where the family's tokenizer is not shipped, a kin one stands in with the
family's turn tokens added as special tokens (Gemma's, Phi's, Granite's, OLMo's)."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from tests.support.hf_tokenizers import (
    FIXTURES,
    load_llama3_tokenizer,
    load_qwen3_tokenizer,
    load_qwen25_tokenizer,
    load_sentencepiece_tokenizer,
    load_smollm2_tokenizer,
)

TEMPLATES = FIXTURES / "templates"
_SIZE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


@dataclass(frozen=True)
class Family:
    name: str
    config_class: str
    config: dict[str, Any]
    tokenizer: str  # a key of TOKENIZERS
    added_tokens: tuple[str, ...] = ()
    template: str | None = None  # a file of tests/fixtures/templates; None: the tokenizer's own
    lean: bool = False  # decodes through kvchat's lean step
    attention: str = "sdpa"  # the attention implementation (Gemma 2 has no SDPA one)


FAMILIES = {
    f.name: f
    for f in (
        Family("llama3", "LlamaConfig", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
               "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}), "llama3", template="llama3.jinja", lean=True),
        Family("llama2", "LlamaConfig", {}, "spm-v1", template="llama2.jinja", lean=True),
        Family("mistral", "MistralConfig", dict(sliding_window=None), "spm-v3", template="mistral.jinja"),
        Family("gemma2", "Gemma2Config", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16),
               "spm-v1", ("<start_of_turn>", "<end_of_turn>"), "gemma2.jinja", attention="eager"),
        Family("gemma3", "Gemma3TextConfig", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
               layer_types=["sliding_attention", "full_attention"]),
               "spm-v1", ("<start_of_turn>", "<end_of_turn>"), "gemma3.jinja"),
        Family("phi3", "Phi3Config", {}, "spm-v1", ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
               "<|endoftext|>"), "phi3.jinja"),
        Family("phi4-mini", "Phi3Config", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
               "partial_rotary_factor": 0.75}), "llama3", ("<|system|>", "<|user|>", "<|assistant|>",
               "<|end|>"), "phi4_mini.jinja"),
        Family("qwen2", "Qwen2Config", {}, "qwen2.5", lean=True),
        Family("qwen3", "Qwen3Config", dict(head_dim=16), "qwen3", lean=True),
        Family("olmo2", "Olmo2Config", {}, "llama3", ("<|system|>", "<|user|>", "<|assistant|>"),
               "olmo2.jinja"),
        Family("granite", "GraniteConfig", {}, "smollm2", ("<|start_of_role|>", "<|end_of_role|>",
               "<|end_of_text|>"), "granite.jinja"),
        Family("smollm2", "LlamaConfig", {}, "smollm2", lean=True),
    )
}  # fmt: skip

TOKENIZERS = {
    "llama3": load_llama3_tokenizer,
    "spm-v1": functools.partial(load_sentencepiece_tokenizer, "v1"),
    "spm-v3": functools.partial(load_sentencepiece_tokenizer, "v3"),
    "qwen2.5": load_qwen25_tokenizer,
    "qwen3": load_qwen3_tokenizer,
    "smollm2": load_smollm2_tokenizer,
}


@functools.cache
def family_tokenizer(name: str) -> Any:
    """The family's tokenizer; one with added turn tokens is a copy (the shared ones stay as they are)."""
    family = FAMILIES[name]
    tokenizer = TOKENIZERS[family.tokenizer]()
    if family.added_tokens:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.add_special_tokens({"additional_special_tokens": list(family.added_tokens)})
    return tokenizer


def family_template(name: str) -> str | None:
    template = FAMILIES[name].template
    return (TEMPLATES / template).read_text() if template else None


def make_family_model(name: str, seed: int = 0, **overrides: Any):
    """A 2-layer random model of the family's own config class, fp32, eval, SDPA attention, with the
    family tokenizer's vocabulary and its BOS/EOS ids."""
    family = FAMILIES[name]
    tokenizer = family_tokenizer(name)
    config_class = getattr(transformers, family.config_class)
    special = {
        key: getattr(tokenizer, key)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if getattr(tokenizer, key, None) is not None
    }
    config = config_class(
        vocab_size=len(tokenizer),
        num_hidden_layers=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        **_SIZE,
        **special,
        **{**family.config, **overrides},
    )
    config._attn_implementation = family.attention
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    return model
