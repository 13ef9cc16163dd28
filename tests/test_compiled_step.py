"""The compiled decode step (`--compile`) equals the module forward: logits after a prompt, across
block boundaries, over a reused prefix whose blocks are not next to the sequence's own; it is taken
only where it applies."""

import json
import random
import resource
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from kvchat.engine.bf16_linears import TiledLinear, can_tile, pack_linears_, tile_linears_
from kvchat.engine.compiled_step import FP32_PAST_UP_TO, MIN_PAST, can_compile, has_cpp_compiler
from kvchat.engine.engine import Engine
from kvchat.models.quantize import quantize_model
from kvchat.native import kernels
from tests.tiny_models import KINDS, make_tiny_model


def compiles(test):
    """Each engine compiles its graph (~10 s); torch.compile needs a C++ compiler."""
    return pytest.mark.slow(pytest.mark.skipif(not has_cpp_compiler(), reason="no C++ compiler")(test))


@pytest.fixture
def without_kernel(monkeypatch):
    """As where kvchat's attention kernel cannot be built: the graph gathers K/V and multiplies."""
    monkeypatch.setattr(kernels, "_build", lambda: (False, "not built in this test"))


def random_ids(n, seed=0, vocab=512):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def engine_of(model, compile_decode: bool) -> Engine:
    return Engine(
        model,
        kv_memory_bytes=1 << 22,
        block_size=16,
        prefill_chunk=512,
        lean_decode=compile_decode,
        compile_decode=compile_decode,
    )


def decode(engine: Engine, seq, tokens: list[int]) -> list[torch.Tensor]:
    """The logits of each token, given one at a time."""
    logits = []
    for token in tokens:
        engine.extend(seq, [token])
        logits.append(engine.compute(seq))
    return logits


def decode_two_sequences(engine: Engine) -> torch.Tensor:
    """Logits of 20 single-token steps of a first sequence, then of 20 steps of a second one that
    reuses the first's two-block prefix, so its K/V lie in two runs of blocks."""
    prefix = random_ids(32)
    out, tables = [], []
    for seed in (1, 2):
        seq = engine.start(prefix + random_ids(5, seed=seed))
        out.append(engine.compute(seq))
        out += decode(engine, seq, random_ids(20, seed=10 + seed))  # crosses the block boundary at 48
        tables.append(seq.block_table)
    first, second = tables
    assert second[:2] == first[:2] and second[2] != second[1] + 1
    return torch.stack(out)


@pytest.mark.parametrize("kind", KINDS)
@compiles
def test_compiled_step_equals_module_forward(kind):
    compiled = engine_of(make_tiny_model(kind), compile_decode=True)
    plain = engine_of(make_tiny_model(kind), compile_decode=False)
    assert compiled.compiled and not plain.compiled
    assert compiled.decode_path == "compiled graph"
    got, expected = decode_two_sequences(compiled), decode_two_sequences(plain)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()


@compiles
def test_compiled_step_without_the_kernel_gathers_and_equals_module_forward(without_kernel):
    compiled = engine_of(make_tiny_model("qwen2"), compile_decode=True)
    plain = engine_of(make_tiny_model("qwen2"), compile_decode=False)
    assert compiled.decode_path == "compiled graph, attention by gather (not built in this test)"
    got, expected = decode_two_sequences(compiled), decode_two_sequences(plain)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()


@compiles
def test_compiled_step_in_bf16_stays_within_bf16_rounding():
    """The graph multiplies by the layers' own weights; the eager steps (the prompt here) by their
    tiles for kvchat's bf16 kernel, where it is built."""
    compiled = engine_of(make_tiny_model("qwen3", dtype=torch.bfloat16), compile_decode=True)
    plain = engine_of(make_tiny_model("qwen3", dtype=torch.bfloat16), compile_decode=False)
    assert compiled.compiled
    if can_tile(nn.Linear(16, 16, dtype=torch.bfloat16)):
        tiled = [m for m in compiled.model.modules() if isinstance(m, TiledLinear)]
        assert tiled and all(m.weight is not None for m in tiled)
    got, expected = decode_two_sequences(compiled), decode_two_sequences(plain)
    torch.testing.assert_close(got.float(), expected.float(), atol=0.15, rtol=0)


@pytest.mark.parametrize("kernel", [True, False])
@compiles
def test_one_graph_serves_long_pasts_in_bf16_within_bf16_rounding(kernel, request):
    """Across 4,096 positions (where inductor's fp32 sums change their code) and, gathering,
    FP32_PAST_UP_TO (attention's products turn bf16), the graph compiled at the first token serves
    every later one."""
    if not kernel:
        request.getfixturevalue("without_kernel")
    prompt = random_ids(4_080)
    results = []
    for compile_decode in (True, False):
        engine = engine_of(make_tiny_model("llama", dtype=torch.bfloat16), compile_decode)
        seq = engine.start(prompt[: FP32_PAST_UP_TO - 10], reuse=False)
        engine.compute(seq)
        logits = decode(engine, seq, random_ids(20, seed=6))  # compiles, then crosses FP32_PAST_UP_TO
        engine.extend(seq, prompt[FP32_PAST_UP_TO - 10 :])
        engine.compute(seq)
        with torch.compiler.set_stance("fail_on_recompile"):
            logits += decode(engine, seq, random_ids(20, seed=7))  # crosses 4,096
        assert seq.num_tokens > 4_096 + 10
        results.append(torch.stack(logits).float())
    torch.testing.assert_close(results[0], results[1], atol=0.15, rtol=0)


@compiles
def test_short_pasts_and_speculation_sized_blocks_take_the_eager_step():
    """Positions below MIN_PAST and multi-token forwards do not go through the graph, and agree."""
    compiled = engine_of(make_tiny_model("llama"), compile_decode=True)
    plain = engine_of(make_tiny_model("llama"), compile_decode=False)
    results = []
    for engine in (compiled, plain):
        seq = engine.start(random_ids(1))
        logits = [engine.compute(seq), *decode(engine, seq, random_ids(MIN_PAST + 2, seed=4))]
        engine.extend(seq, random_ids(6, seed=5))
        logits.extend(engine.compute(seq, all_logits=True))
        results.append(torch.stack(logits))
    torch.testing.assert_close(results[0], results[1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@compiles
def test_quantized_models_compile_and_equal_their_module_forward(mode, capfd, monkeypatch, tmp_path):
    """int8 layers go through inductor's weight-only template instead of torch's kernel, int4 ones
    through kvchat's kernel (or inductor's template): the same codes and scales, so the same logits up
    to the order of the sums. Autotuning, which an empty compile cache makes run, writes nothing to the
    terminal. The int4 output layer is rescored, its rows few enough that the graph runs the rescoring."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    models = [make_tiny_model("qwen2") for _ in range(2)]
    for model in models:
        quantize_model(model, mode)
        if mode == "int4":
            model.lm_head.num_exact = 16  # of 512: at the default, every row would take the exact layer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = engine_of(models[0], compile_decode=True)
    plain = engine_of(models[1], compile_decode=False)
    assert compiled.compiled
    assert "AUTOTUNE" not in capfd.readouterr().err
    assert not [str(w.message) for w in caught if "compile" in w.filename or "_inductor" in w.filename]
    got, expected = decode_two_sequences(compiled), decode_two_sequences(plain)
    torch.testing.assert_close(got, expected, atol=0.02, rtol=0)
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()


@pytest.mark.parametrize("length", [FP32_PAST_UP_TO - 1, FP32_PAST_UP_TO + 1])
def test_attention_products_over_the_past_equal_fp32_ones(length):
    """Either side of FP32_PAST_UP_TO, the graph's attention ops give fp32 results within bf16's
    rounding of the operands' exact products."""
    torch.manual_seed(0)
    query, keys, values = (torch.randn(2, n, 16, dtype=torch.bfloat16) for n in (3, length, length))
    probs = torch.randn(2, 3, length).softmax(-1)
    scores = torch.ops.kvchat.past_scores(query, keys)
    mixed = torch.ops.kvchat.past_mix(probs, values)
    assert scores.dtype == mixed.dtype == torch.float32
    torch.testing.assert_close(scores, query.float() @ keys.float().transpose(1, 2), atol=0.05, rtol=0.01)
    torch.testing.assert_close(mixed, probs.to(torch.bfloat16).float() @ values.float(), atol=0.01, rtol=0.01)


def test_linears_packed_for_onednn_are_not_compiled_tiled_ones_are():
    model = make_tiny_model("qwen2", dtype=torch.bfloat16)
    assert can_compile(model)
    pack_linears_(model)
    assert not can_compile(model)
    assert not engine_of(model, compile_decode=True).compiled
    tiled = make_tiny_model("qwen2", dtype=torch.bfloat16)
    if tile_linears_(tiled):
        assert can_compile(tiled)


# A block a little larger each time, as the graph's buffers grow with the context by a position a
# token, freed before the next; prints how many of the blocks were in the heap, and the page faults
# of allocating and filling one, averaged over the last 10 of 30.
_GROWING_BLOCKS = """
import json, resource, sys, torch
if sys.argv[1] == "keep":
    from kvchat.engine.compiled_step import keep_freed_memory
    keep_freed_memory()
def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            start, end = line.split()[0].split("-")
            return int(start, 16), int(end, 16)
    return 0, 0
faults, in_heap = [], 0
for i in range(30):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.empty((8 << 20) + i * (64 << 10), dtype=torch.uint8).fill_(1)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    start, end = heap()
    in_heap += start <= block.data_ptr() < end
    del block
print(json.dumps({"in_heap": in_heap, "faults": sum(faults[-10:]) / 10}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_buffers_stay_in_the_heap_for_the_next_token():
    def blocks(mode: str) -> dict:
        run = subprocess.run([sys.executable, "-c", _GROWING_BLOCKS, mode], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout)

    pages = (8 << 20) // resource.getpagesize()
    default, keep = blocks("default"), blocks("keep")
    # By default each block is mmapped afresh and unmapped when freed: every page faulted in anew.
    assert default["in_heap"] == 0 and default["faults"] > pages
    # Kept, every block comes from the heap, and freed stays there: the next reuses its pages (16-32
    # faults a block, its growth) once the small allocations between them stop landing past it,
    # which takes the first 3 to 9 blocks.
    assert keep["in_heap"] == 30 and keep["faults"] < pages / 8
