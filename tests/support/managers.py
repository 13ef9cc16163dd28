"""ContextManagers on tiny random models with the real SmolLM2 tokenizer and chat template, the texts
they are given, and the checks run on them."""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Iterable

from kvchat.chunks.compose import RepairPolicy
from kvchat.chunks.context import ContextManager
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import InferenceResult, ReuseMode
from kvchat.engine.engine import Engine
from kvchat.engine.generate import PrefillProgress
from kvchat.engine.records import GenerationStep
from kvchat.engine.sampling import SamplingParams
from kvchat.session import repair_policy
from kvchat.settings_schema import ReuseSettings
from tests.support.hf_tokenizers import load_smollm2_tokenizer
from tests.support.tiny_models import make_tiny_model

WORDS = "the cat sat on a mat while rain fell over quiet hills and rivers ran to the sea".split()
GREEDY = SamplingParams(max_tokens=8)


def text(seed: int, n: int = 12) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def tiny_llama():
    """A tiny random Llama with SmolLM2's vocabulary, for `make_manager`."""
    return make_tiny_model("llama", vocab_size=49152)


def make_manager(model, block_size=4, kv_memory=1 << 23, mode=ReuseMode.EXACT) -> ContextManager:
    tokenizer = load_smollm2_tokenizer()
    engine = Engine(model, kv_memory_bytes=kv_memory, block_size=block_size, prefill_chunk=16)
    return ContextManager(
        engine,
        ChatFormat(tokenizer),
        tokenizer,
        frozenset({2}),
        model_id="tiny",
        fingerprint="tiny-1",
        mode=mode,
    )


@functools.cache
def small_pool_model():
    """The tiny Qwen2 behind `small_pool_manager`, built at first use."""
    return make_tiny_model("qwen2", vocab_size=49152, seed=1)


def small_pool_manager() -> ContextManager:
    """A manager whose pool holds 96 blocks of 4 tokens, so that evictions and refusals come soon."""
    model, tokenizer = small_pool_model(), load_smollm2_tokenizer()
    block_bytes = Engine(model, kv_memory_bytes=1 << 20, block_size=4, prefill_chunk=512).bytes_per_block
    engine = Engine(model, kv_memory_bytes=block_bytes * 96, block_size=4, prefill_chunk=8)
    return ContextManager(engine, ChatFormat(tokenizer), tokenizer, frozenset({2}), fingerprint="tiny")


def drain(stream: Iterable[object]) -> InferenceResult:
    """The result of a stream that must finish: steps and progress, then the InferenceResult."""
    items = list(stream)
    assert all(isinstance(i, GenerationStep | PrefillProgress) for i in items[:-1])
    assert isinstance(items[-1], InferenceResult)
    return items[-1]


def drain_maybe(stream: Iterable[object]) -> InferenceResult | None:
    """The result of a stream a fault may have cut short (None then)."""
    items = list(stream)
    return items[-1] if items and isinstance(items[-1], InferenceResult) else None


def repair(**changes) -> RepairPolicy:
    """The policy the default settings make, with `changes`."""
    return dataclasses.replace(repair_policy(ReuseSettings()), **changes)


def assert_refs_match(cm: ContextManager) -> None:
    """Every reference on a block is one the manager can name: no leak, no double release."""
    blocks = cm.engine.blocks
    blocks.check_invariants()
    held = cm.held_blocks()
    pinned = {b: 0 for b in held}
    for chunk in cm.registry.chunks.values():
        if chunk.span is not None and chunk.span.pinned:
            for b in chunk.span.block_ids:
                pinned[b] += 1
    for block in blocks.blocks:
        assert block.ref_count == held.get(block.block_id, 0), f"block {block.block_id} leaked"
        assert block.pin_count == pinned.get(block.block_id, 0)
