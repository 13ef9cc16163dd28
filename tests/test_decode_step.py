"""The decode fast paths equal the plain ones: grouped attention against SDPA, the lean decode step
against the module forward (logits and greedy text)."""

import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvchat.engine.decode_step import MAX_LEAN_TOKENS, make_decode_step, rms_norm, rope
from kvchat.engine.detokenizer import StreamDetokenizer
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate
from kvchat.engine.paged_attention import grouped_attention
from kvchat.engine.sampling import SamplingParams
from kvchat.linears.bf16_linears import (
    PackedLinear,
    TiledLinear,
    UpcastLinear,
    can_pack,
    can_tile,
    fallback_kind,
    onednn_packs_bf16,
    serve_bf16_linears_,
)
from kvchat.native import kernels
from kvchat.native.kernels import has_cpp_compiler
from tests.support.tiny_models import KINDS, make_tiny_model


def sdpa_reference(query, keys, values, scaling):
    """SDPA with K/V repeated per query head and an explicit causal mask for the last q positions."""
    group = query.shape[1] // keys.shape[1]
    num_new, length = query.shape[2], keys.shape[2]
    allowed = torch.arange(length)[None] <= torch.arange(length - num_new, length)[:, None]  # (q, T)
    out = F.scaled_dot_product_attention(
        query.float(),
        keys.repeat_interleave(group, dim=1).float(),
        values.repeat_interleave(group, dim=1).float(),
        attn_mask=allowed,
        scale=scaling,
    )  # (1, Hq, q, D)
    return out.transpose(1, 2).reshape(1, num_new, -1)


def pool_runs(keys, values, sizes):
    """(1, Hk, T, D) K/V placed in a head-major pool layer among other slots, runs of `sizes` apart,
    and read back as views of those runs."""
    bounds = [0, *itertools.accumulate(sizes)]
    assert bounds[-1] == keys.shape[2]
    pool_k = torch.zeros(keys.shape[1], 3 * bounds[-1], keys.shape[3], dtype=keys.dtype)  # (Hk, S, D)
    pool_v = torch.zeros_like(pool_k)
    runs = []
    for index, (a, b) in enumerate(itertools.pairwise(bounds)):
        at = 2 * a + index  # gaps between the runs
        pool_k[:, at : at + b - a], pool_v[:, at : at + b - a] = keys[0, :, a:b], values[0, :, a:b]
        runs.append((pool_k[:, at : at + b - a], pool_v[:, at : at + b - a]))
    return runs


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_new", [1, 5])
@pytest.mark.parametrize("sizes", [[7], [300], [1, 6], [64, 16, 200, 20]])
def test_grouped_attention_over_runs_equals_sdpa(dtype, tol, num_new, sizes):
    torch.manual_seed(0)
    length = sum(sizes)
    query = torch.randn(1, 6, num_new, 16).to(dtype)
    keys, values = torch.randn(1, 2, length, 16).to(dtype), torch.randn(1, 2, length, 16).to(dtype)
    got = grouped_attention(query, pool_runs(keys, values, sizes), 0.25)
    torch.testing.assert_close(got.float(), sdpa_reference(query, keys, values, 0.25), atol=tol, rtol=0)


def test_grouped_attention_of_a_query_laid_out_as_after_a_projection():
    torch.manual_seed(1)
    keys, values = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    query = torch.randn(1, 4, 3, 16).transpose(1, 2).contiguous().transpose(1, 2)
    got = grouped_attention(query, pool_runs(keys, values, [40]), 0.25)
    torch.testing.assert_close(got, sdpa_reference(query, keys, values, 0.25), atol=1e-5, rtol=0)


def random_ids(n, seed=0, vocab=512):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("kind", KINDS)
def test_lean_step_is_chosen_for_the_supported_families(kind):
    model = make_tiny_model(kind)
    assert make_decode_step(model) is not None
    assert (
        Engine(
            model, kv_memory_bytes=1 << 22, block_size=16, prefill_chunk=512, lean_decode=False
        )._decode_step
        is None
    )


def decode_logits(engine, prompt, steps):
    """Logits of the prompt's last token, then of each step's token and of a speculation-sized block."""
    seq = engine.start(prompt)
    out = [engine.compute(seq)]
    for token in steps:
        engine.extend(seq, [token])
        out.append(engine.compute(seq))
    engine.extend(seq, random_ids(MAX_LEAN_TOKENS, seed=3))
    out.extend(engine.compute(seq, all_logits=True))
    engine.free(seq)
    return torch.stack(out)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.15)])
@pytest.mark.parametrize("kernel", [True, False])
def test_lean_step_equals_module_forward(kind, dtype, tol, kernel, monkeypatch):
    """Lean step (with bf16 linears on kvchat's kernel, else oneDNN's or UpcastLinear by what this CPU runs)
    against the module forward of an untouched twin model; single tokens attend through kvchat's
    kernel, or, where it is not built, over gathered runs."""
    if kernel and not has_cpp_compiler():
        pytest.skip("the kernel is built with a C++ compiler")
    if not kernel:
        monkeypatch.setattr(kernels, "_build", lambda: (False, "not built in this test"))
    prompt, steps = random_ids(37), random_ids(5, seed=2)
    lean_engine = Engine(
        make_tiny_model(kind, dtype=dtype), kv_memory_bytes=1 << 22, block_size=16, prefill_chunk=512
    )
    expected_path = "lean step" if kernel else "lean step, attention by gather (not built in this test)"
    assert lean_engine.decode_path == expected_path
    probe = nn.Linear(16, 16, dtype=dtype)
    # with the kernels, every layer in one op (decoder_layers) where its linears are kvchat's or plain
    # fp32; else torch's ops a layer at a time
    one_op = kernel and (dtype == torch.float32 or can_tile(probe))
    assert (lean_engine._decode_step.parts is not None) == one_op
    plain_engine = Engine(
        make_tiny_model(kind, dtype=dtype),
        kv_memory_bytes=1 << 22,
        block_size=16,
        prefill_chunk=512,
        lean_decode=False,
    )
    replaced = TiledLinear if can_tile(probe) else fallback_kind(onednn_packs_bf16())
    if dtype == torch.bfloat16:
        assert all(type(m) is not nn.Linear for m in lean_engine.model.modules())
        assert any(isinstance(m, replaced) for m in lean_engine.model.modules())
    served = PackedLinear | TiledLinear | UpcastLinear
    assert not any(isinstance(m, served) for m in plain_engine.model.modules())
    lean, plain = decode_logits(lean_engine, prompt, steps), decode_logits(plain_engine, prompt, steps)
    torch.testing.assert_close(lean.float(), plain.float(), atol=tol, rtol=0)
    if dtype == torch.float32:
        assert lean.argmax(-1).tolist() == plain.argmax(-1).tolist()


@pytest.mark.parametrize("num_rows", [1, 5, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear(num_rows, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=bias, dtype=torch.bfloat16)
    if not can_pack(linear):
        pytest.skip("this torch has no oneDNN packed linear")
    x = torch.randn(1, num_rows, 96, dtype=torch.bfloat16)
    want = linear(x)
    got = PackedLinear(linear)(x)
    assert got.shape == want.shape == (1, num_rows, 80)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=1e-2)


def test_only_exact_cpu_bf16_linears_are_served():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8, dtype=torch.bfloat16), nn.Embedding(4, 8))
    assert serve_bf16_linears_(model) == 1
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Embedding
    assert type(model[1]) is fallback_kind(onednn_packs_bf16())


def test_a_cpu_whose_onednn_takes_no_bf16_gets_upcast_linears():
    """Which CPU answers what (AVX-512 or AVX-NE-CONVERT for oneDNN's bf16) is the machine's; the choice
    made from each answer is tested here whatever this CPU is."""
    assert fallback_kind(True) is PackedLinear
    assert fallback_kind(False) is UpcastLinear
    probe = torch.zeros(16, 16, dtype=torch.bfloat16)
    try:
        torch.ops.mkldnn._reorder_linear_weight(probe, 1)
        packs = True
    except (RuntimeError, AttributeError):
        packs = False
    assert onednn_packs_bf16() == packs


@pytest.mark.parametrize("num_rows", [1, 3, 4, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_upcast_linear_equals_the_fp32_product_rounded_once(num_rows, bias, monkeypatch):
    from kvchat.linears import bf16_linears

    monkeypatch.setattr(bf16_linears, "UPCAST_BLOCK_BYTES", 96 * 4 * 16)  # blocks of 16 of the 80 rows
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=bias, dtype=torch.bfloat16)
    x = torch.randn(2, num_rows, 96, dtype=torch.bfloat16)
    got = UpcastLinear.of(linear)(x)
    assert got.shape == (2, num_rows, 80) and got.dtype == torch.bfloat16
    wide = F.linear(x.float(), linear.weight.float(), None if not bias else linear.bias.float())
    if 2 * num_rows >= bf16_linears.UPCAST_ROWS:
        torch.testing.assert_close(got.float(), wide.to(torch.bfloat16).float(), atol=1e-2, rtol=8e-3)
    else:
        assert torch.equal(got, linear(x))  # torch's bf16 product, as the layer it replaced
    assert UpcastLinear.of(linear).weight is linear.weight  # held once: a tied weight stays tied


def test_the_lean_step_on_upcast_linears_equals_the_module_forward(monkeypatch):
    """What a CPU without AVX-512 runs when kvchat's kernels are not built, on any CPU."""
    from kvchat.linears import bf16_linears

    monkeypatch.setattr(kernels, "_build", lambda: (False, "not built in this test"))
    monkeypatch.setattr(bf16_linears, "onednn_packs_bf16", lambda: False)
    prompt, steps = random_ids(37), random_ids(5, seed=2)
    kwargs = {"kv_memory_bytes": 1 << 22, "block_size": 16, "prefill_chunk": 512}
    lean_engine = Engine(make_tiny_model("llama", dtype=torch.bfloat16), **kwargs)
    assert any(isinstance(m, UpcastLinear) for m in lean_engine.model.modules())
    plain_engine = Engine(make_tiny_model("llama", dtype=torch.bfloat16), lean_decode=False, **kwargs)
    lean, plain = decode_logits(lean_engine, prompt, steps), decode_logits(plain_engine, prompt, steps)
    torch.testing.assert_close(lean.float(), plain.float(), atol=0.15, rtol=0)


@pytest.mark.slow  # the real model
def test_lean_step_gives_the_same_greedy_text_on_smollm2(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write two sentences about the sea."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    texts = []
    for lean in (True, False):
        engine = Engine(model, kv_memory_bytes=1 << 26, block_size=16, prefill_chunk=512, lean_decode=lean)
        seq = engine.start(list(prompt))
        params = SamplingParams(max_tokens=40)
        steps = generate(engine, seq, params, frozenset(), StreamDetokenizer(tokenizer))
        texts.append("".join(step.text for step in steps))
        engine.free(seq)
    assert texts[0] == texts[1] and len(texts[0]) > 40


@pytest.mark.parametrize("mode", ["int8", "int4", "int4-g128"])
def test_lean_step_runs_quantized_linears_as_the_module_forward_does(mode):
    """The lean step runs quantized layers on their own kernels (inside decoder_layers, or as the model's
    modules), so they give the module forward's logits: the same kernels on inputs that differ by
    fp32's rounding of the ops around them, which the int8 output layer's bf16 logits may turn into a
    unit or two of their last place."""
    from kvchat.models.quantize import quantize_model

    engines = []
    for lean in (True, False):
        model = make_tiny_model("qwen2", dtype=torch.float32)
        assert quantize_model(model, mode).num_replaced > 0
        engines.append(
            Engine(model, kv_memory_bytes=1 << 22, block_size=16, prefill_chunk=512, lean_decode=lean)
        )
    assert engines[0]._decode_step is not None
    # kvchat's int4 and int8 kernels run inside decoder_layers where they are built
    assert (engines[0]._decode_step.parts is not None) == (kernels.int4_linear() is not None)
    prompt, steps = random_ids(37), random_ids(5, seed=2)
    lean, plain = (decode_logits(engine, prompt, steps) for engine in engines)
    torch.testing.assert_close(lean, plain, atol=1e-3, rtol=2**-7)
    assert lean.argmax(-1).tolist() == plain.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_the_families_rotation_exactly(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(2)
    query, keys = torch.randn(1, 6, 3, 16).to(dtype), torch.randn(1, 2, 3, 16).to(dtype)
    angles = torch.randn(1, 3, 8)
    cos, sin = (torch.cat([f(angles), f(angles)], dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    want_q, want_k = apply_rotary_pos_emb(query, keys, cos, sin)
    signed_sin = torch.cat([-sin[..., :8], sin[..., 8:]], dim=-1).unsqueeze(1)
    assert torch.equal(rope(query, cos.unsqueeze(1), signed_sin), want_q)
    assert torch.equal(rope(keys, cos.unsqueeze(1), signed_sin), want_k)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 0.0)])
def test_fused_rms_norm_equals_the_families_module(kind, native, dtype, tol, monkeypatch):
    if native and not kernels.built():
        pytest.skip(f"kvchat's kernels are not built: {kernels.build_error()}")
    if not native:
        monkeypatch.setattr(kernels, "built", lambda: False)  # torch's fallback
    model = make_tiny_model(kind, dtype=dtype)
    norm = model.model.layers[0].input_layernorm
    norm.weight.data = torch.randn_like(norm.weight)
    x = (torch.randn(1, 3, norm.weight.shape[0]) * 3).to(dtype)
    torch.testing.assert_close(rms_norm(norm, x), norm(x), atol=tol, rtol=tol)


def test_a_norm_of_another_dtype_keeps_the_layer_loop():
    """decoder_layers takes norm weights of the model's dtype only; another keeps the loop in Python."""
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    model.model.layers[1].post_attention_layernorm.float()
    engine = Engine(model, kv_memory_bytes=1 << 22, block_size=16, prefill_chunk=512)
    assert engine._decode_step is not None and engine._decode_step.parts is None
