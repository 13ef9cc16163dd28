"""kvchat on a CUDA GPU: the paged engine, sampling, speculation, quantized linears on torch's kernels,
chunk reuse and the command itself, each against the plain forward or the CPU.

CI has no GPU, so these are skipped there; on a machine with one, `pytest -m cuda` runs them.
"""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from kvchat.chunks.context import ContextManager
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import InferenceResult
from kvchat.engine.detokenizer import StreamDetokenizer
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate
from kvchat.engine.records import GenerationStep, SamplingParams
from kvchat.linears.quantized_linears import Int4Linear, Int8Linear
from kvchat.models.quantize import quantize_model
from tests.support.hf_tokenizers import load_qwen25_tokenizer
from tests.support.speculation import EveryMatch, repeating_prompt, varied_model
from tests.support.tiny_models import KINDS, make_tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU"),
]

CUDA = torch.device("cuda")
# fp32 on the GPU: another summation order than the full forward's kernels, never TF32
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.15}
IM_END = 151645


def random_ids(n: int, seed: int = 0, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def full_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([token_ids], device=CUDA)).logits[0].float()  # (T, V)


class Ids:
    """A detokenizer's tokenizer for models whose tokens have no text."""

    def decode(self, token_ids: list[int], **kwargs) -> str:
        return "".join(f"<{t}>" for t in token_ids)


def generated_ids(model, prompt: list[int], params: SamplingParams, drafter=None) -> list[int]:
    engine = Engine(model, kv_memory_bytes=1 << 22, block_size=4, prefill_chunk=512)
    seq = engine.start(prompt)
    steps = generate(engine, seq, params, frozenset(), StreamDetokenizer(Ids()), drafter)
    ids = [s.token_id for s in steps if isinstance(s, GenerationStep)]
    engine.free(seq)
    engine.blocks.check_invariants()
    return ids


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_and_decode_on_cuda_equal_the_full_forward(kind, dtype):
    model = make_tiny_model(kind, dtype=dtype).to(CUDA)
    engine = Engine(model, kv_memory_bytes=1 << 22, block_size=16, prefill_chunk=7)
    assert engine.device.type == "cuda" and engine.pool.keys.is_cuda
    assert engine.decode_path.startswith("lean step, attention by gather")  # kvchat's kernels: CPU only
    ids, steps = random_ids(40), [5, 6, 7]
    expected = full_logits(model, ids + steps)
    seq = engine.start(ids)
    got = [engine.compute(seq, all_logits=True).float()]
    for token in steps:
        engine.extend(seq, [token])
        got.append(engine.compute(seq).float()[None])
    torch.testing.assert_close(torch.cat(got), expected, atol=TOLERANCE[dtype], rtol=0)
    engine.free(seq)
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("kind", KINDS)
def test_shared_prefix_and_sequences_in_turn_on_cuda(kind):
    """A second prompt computes only its new tail; two sequences that decode in turn interleave their
    blocks in the pool; every logit is still the full forward's."""
    model = make_tiny_model(kind).to(CUDA)
    engine = Engine(model, kv_memory_bytes=1 << 22, block_size=4, prefill_chunk=512)
    first = random_ids(30, seed=1)
    seq = engine.start(first)
    engine.compute(seq)
    second = first[:22] + random_ids(9, seed=2)
    other = engine.start(second)
    assert other.num_computed == 22
    ids = {id(seq): list(first), id(other): list(second)}
    for step in range(6):
        for s in (seq, other):
            token = random_ids(1, seed=10 * step + len(ids[id(s)]))[0]
            engine.extend(s, [token])
            ids[id(s)].append(token)
            got = engine.compute(s).float()
            assert (got - full_logits(model, ids[id(s)])[-1]).abs().max() <= TOLERANCE[torch.float32]
    engine.free(seq)
    engine.free(other)
    engine.blocks.check_invariants()


def test_cuda_decodes_the_cpus_logits():
    cpu_model = make_tiny_model("qwen2")
    cuda_model = make_tiny_model("qwen2").to(CUDA)
    prompt = random_ids(33, seed=4)
    logits = []
    for model in (cpu_model, cuda_model):
        engine = Engine(model, kv_memory_bytes=1 << 22, block_size=8, prefill_chunk=512)
        seq = engine.start(prompt)
        rows = [engine.compute(seq)]
        for token in random_ids(4, seed=5):
            engine.extend(seq, [token])
            rows.append(engine.compute(seq))
        logits.append(torch.stack(rows).float().cpu())
    torch.testing.assert_close(logits[1], logits[0], atol=1e-3, rtol=0)


def test_seeded_sampling_on_cuda_repeats_and_greedy_follows_the_argmax():
    model = varied_model("llama").to(CUDA)
    prompt = random_ids(20, seed=6, vocab=64)
    sampled = SamplingParams(
        temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.1, max_tokens=24, seed=3
    )
    assert generated_ids(model, prompt, sampled) == generated_ids(model, prompt, sampled)
    assert len(generated_ids(model, prompt, sampled)) == 24
    greedy = generated_ids(model, prompt, SamplingParams(max_tokens=12))
    ids = list(prompt)
    for token in greedy:
        assert token == int(full_logits(model, ids)[-1].argmax())
        ids.append(token)


def test_prompt_lookup_on_cuda_gives_the_plain_greedy_answer():
    model = varied_model("qwen2", seed=1).to(CUDA)
    prompt = repeating_prompt(1)
    params = SamplingParams(max_tokens=40)
    assert generated_ids(model, prompt, params, EveryMatch()) == generated_ids(model, prompt, params)


@pytest.mark.parametrize("mode", ["int8", "int4", "int4-g128"])
def test_quantized_model_on_cuda_runs_torchs_kernels_and_keeps_its_logits(mode):
    plain = make_tiny_model("qwen2", dtype=torch.bfloat16).to(CUDA)
    quantized = make_tiny_model("qwen2", dtype=torch.bfloat16).to(CUDA)
    report = quantize_model(quantized, mode)
    assert report.num_replaced == 2 * 7 + 1 and not report.refused
    layers = [m for m in quantized.modules() if isinstance(m, Int8Linear | Int4Linear)]
    assert layers and all(layer.kernel == "torch" for layer in layers)
    x = torch.randn(5, 64, device=CUDA, dtype=torch.bfloat16)
    layer = layers[0]
    expected = x.float() @ layer.dequantized_weight().float().T + layer.bias.float()
    torch.testing.assert_close(
        layer(x).float(), expected, rtol=2**-6, atol=2**-7 * float(expected.abs().max())
    )
    ids = random_ids(40, seed=9)
    want = full_logits(plain, ids).log_softmax(-1)
    got = full_logits(quantized, ids).log_softmax(-1)
    kl = float((want.exp() * (want - got)).sum(-1).mean())
    assert kl < (1e-4 if mode == "int8" else 2e-3), kl
    engine = Engine(quantized, kv_memory_bytes=1 << 22, block_size=16, prefill_chunk=512)
    seq = engine.start(ids[:30])
    rows = [engine.compute(seq, all_logits=True).float()]
    for token in ids[30:]:
        engine.extend(seq, [token])
        rows.append(engine.compute(seq).float()[None])
    torch.testing.assert_close(torch.cat(rows), full_logits(quantized, ids), atol=0.15, rtol=0)


def qwen_manager(model) -> ContextManager:
    tokenizer = load_qwen25_tokenizer()
    engine = Engine(model, kv_memory_bytes=1 << 23, block_size=8, prefill_chunk=64)
    return ContextManager(engine, ChatFormat(tokenizer), tokenizer, frozenset({IM_END}))


def test_chunk_reuse_on_cuda_gives_the_cold_answer():
    model = make_tiny_model("qwen2", vocab_size=151936).to(CUDA)
    params = SamplingParams(max_tokens=10)
    cm = qwen_manager(model)
    cm.set_system("You are terse.")
    cm.add_context("The Rhine flows north and ends in the North Sea.")
    cm.set_query("Where does the Rhine end?")
    first = cm.infer_blocking(params)
    second = cm.infer_blocking(params)
    assert isinstance(second, InferenceResult)
    assert first.reused_tokens == 0 and second.computed_tokens == 1
    assert second.text == first.text and len(first.token_ids) == 10
    cm.use_output(first.output_number)
    cm.set_query("Say it again.")
    warm = cm.infer_blocking(params)
    assert warm.reused_tokens > first.prompt_tokens // 2
    report = cm.verify(6)
    # exact reuse against a full recompute of the same context on the GPU
    assert report.top1_agree and report.greedy_agree == report.greedy_tokens == 6
    assert report.kl_divergence < 1e-3


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    """A local model folder: a tiny random Qwen2 with the real Qwen tokenizer and Qwen2.5's template."""
    folder = tmp_path_factory.mktemp("tiny-qwen")
    make_tiny_model("qwen2", vocab_size=151936).save_pretrained(folder)
    load_qwen25_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_the_command_chats_on_the_gpu(qwen_folder, tmp_path, quantize):
    script = b"/info\n/system You are terse.\n/query Where does the Rhine end?\n/infer\n/infer\n/verify 4\n"
    args = [
        "--model",
        str(qwen_folder),
        "--device",
        "cuda",
        "--quantize",
        quantize,
        "--json",
        "--max-tokens",
        "8",
    ]
    env = {**os.environ, "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / ".config")}
    proc = subprocess.run(
        [sys.executable, "-m", "kvchat", *args], input=script, capture_output=True, env=env, timeout=1800
    )
    assert proc.returncode == 0, proc.stderr.decode()
    out = [json.loads(line) for line in proc.stdout.decode().splitlines() if line.strip()]
    info = out[0]["info"]
    assert info["device"].startswith("cuda") and info["dtype"] == "bf16"
    assert info["quantization"].startswith(quantize)
    first, second = (r for r in out if r["cmd"] == "infer")
    assert second["computed_tokens"] == 1 and second["output"] == first["output"]
    assert next(r for r in out if r["cmd"] == "verify")["fidelity"]["greedy_tokens"] >= 1
