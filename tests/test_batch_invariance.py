"""A token's logits are the same bits whatever is computed with it: a ~600-token prompt's every position
computed in one prefill, in prefill chunks of 1, 7 and 64 tokens, as a cached prefix plus the one token,
and among a speculation verification's 4 drafts, on the lean step with kvchat's kernels (bf16, fp32,
int8, int4), for a tiny random Qwen3 and the real SmolLM2. With batch invariance off, a long chunk takes
the module forward, whose rounding differs."""

import random

import pytest
import torch

from kvchat.engine.engine import Engine
from kvchat.native import kernels
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(
    not kernels.linears_built(),
    reason=f"kvchat's linear kernels are not built ({kernels.tier()} tier): {kernels.build_error()}",
)

NUM_TOKENS = 600
KINDS = ["bf16", "fp32", "bf16-int8", "bf16-int4"]


def make_model(kind: str, load):
    """`load(dtype)` in the kind's dtype, quantized as its mode asks."""
    dtype, _, mode = kind.partition("-")
    model = load({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
    if mode:
        from kvchat.models.quantize import quantize_model

        quantize_model(model, mode)
    return model


def engine_of(model, prefill_chunk: int, batch_invariant: bool = True) -> Engine:
    return Engine(
        model,
        kv_memory_bytes=1 << 28,
        block_size=16,
        prefill_chunk=prefill_chunk,
        batch_invariant=batch_invariant,
    )


def prompt_of(vocab_size: int) -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(3, vocab_size) for _ in range(NUM_TOKENS)]


def every_position(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """The logits of every position of `prompt`, computed from nothing: (T, V)."""
    seq = engine.start(prompt, reuse=False)
    try:
        return engine.compute(seq, all_logits=True)
    finally:
        engine.free(seq)


def cached_prefix_then_one(engine: Engine, prompt: list[int], position: int) -> torch.Tensor:
    """The logits of `position` computed alone, after its prefix found cached (whole blocks shared,
    the rest copied): (V,)."""
    seq = engine.start(prompt[: position + 1])
    try:
        assert seq.num_computed == position  # everything before it was reused
        return engine.compute(seq)
    finally:
        engine.free(seq)


def verified_with_drafts(engine: Engine, prompt: list[int], position: int, num_drafts: int) -> torch.Tensor:
    """Logits of `position` and the `num_drafts` after it, in one forward, as speculation checks its
    drafts (nothing recorded): (1 + k, V)."""
    seq = engine.start(prompt[: position + 1], reuse=False)
    try:
        engine.compute(seq, until=position)
        engine.extend(seq, prompt[position + 1 : position + 1 + num_drafts])
        return engine.compute(seq, all_logits=True, record=False)
    finally:
        engine.free(seq)


def check_invariance(model) -> None:
    prompt = prompt_of(model.config.vocab_size)
    whole = engine_of(model, prefill_chunk=1024)
    assert whole.batch_invariance is None, whole.batch_invariance
    reference = every_position(whole, prompt)  # (T, V), one prefill
    for chunk in (1, 7, 64):
        assert torch.equal(every_position(engine_of(model, chunk), prompt), reference), f"chunks of {chunk}"
    seq = whole.start(prompt, reuse=False)  # indexed: its blocks are found by the next sequences
    whole.compute(seq)
    for position in (1, 15, 16, 17, 333, NUM_TOKENS - 1):
        assert torch.equal(cached_prefix_then_one(whole, prompt, position), reference[position])
    whole.free(seq)
    for position in (1, 100, 421, NUM_TOKENS - 5):
        rows = verified_with_drafts(whole, prompt, position, num_drafts=4)
        assert torch.equal(rows, reference[position : position + 5])


@pytest.mark.parametrize(
    "kind",
    # bf16, the dtype kvchat picks where the CPU has it, in the fast lane; every kind in the full suite
    [pytest.param(kind, marks=[] if kind == "bf16" else [pytest.mark.slow]) for kind in KINDS],
)
def test_a_tiny_qwen3s_logits_are_the_same_bits_however_they_are_batched(kind):
    check_invariance(make_model(kind, lambda dtype: make_tiny_model("qwen3", dtype=dtype)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_smollm2s_logits_are_the_same_bits_however_they_are_batched(kind):
    from transformers import AutoModelForCausalLM

    from kvchat.models.packaged import ensure_converted

    # a model of its own: an engine tiles its linears in place
    check_invariance(
        make_model(kind, lambda dtype: AutoModelForCausalLM.from_pretrained(ensure_converted(), dtype=dtype))
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_threads_change_no_bit(on_one_then_two_threads, dtype):
    model = make_tiny_model("qwen3", dtype=dtype)
    prompt = prompt_of(model.config.vocab_size)
    one, two = on_one_then_two_threads(lambda: every_position(engine_of(model, 64), prompt))
    assert torch.equal(one, two)


def test_with_batch_invariance_off_a_long_chunk_takes_the_module_forward():
    """The opt-out: a prefill chunk past speculation's size runs the module forward, whose rounding
    depends on the chunk, so the same positions differ in their last bits."""
    model = make_tiny_model("qwen3", dtype=torch.bfloat16)
    prompt = prompt_of(model.config.vocab_size)[:100]
    try:
        loose = engine_of(model, prefill_chunk=1024, batch_invariant=False)
        assert loose.batch_invariance == "off (model.batch_invariant)"
        one_at_a_time = every_position(engine_of(model, 1, batch_invariant=False), prompt)
        whole = every_position(loose, prompt)
        assert not torch.equal(whole, one_at_a_time)
        torch.testing.assert_close(whole.float(), one_at_a_time.float(), atol=0.15, rtol=0)
    finally:
        kernels.set_batch_invariant(True)


def test_an_engine_names_why_its_logits_may_depend_on_the_batch():
    def why(model, **options) -> str | None:
        return Engine(
            model, kv_memory_bytes=1 << 24, block_size=16, prefill_chunk=64, **options
        ).batch_invariance

    assert why(make_tiny_model("llama")) is None
    assert why(make_tiny_model("llama"), lean_decode=False) == "the module forward decodes this model"
    dynamic = make_tiny_model("llama")
    dynamic.model.rotary_emb.rope_type = "dynamic"
    assert why(dynamic) == "its rotary embedding changes with the length"
