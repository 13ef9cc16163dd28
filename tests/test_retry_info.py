"""/retry, /info and --ctx-size on the real ContextManager over a tiny random model."""

import types

import pytest
import torch

from kvchat.chunks.types import Role
from kvchat.config import CacheSettings
from kvchat.engine.engine import Engine
from kvchat.engine.records import GenerationStep
from kvchat.engine.sampling import SamplingParams
from kvchat.errors import CacheFullError, ChunkError
from kvchat.native import kernels
from kvchat.session import kv_memory_bytes
from tests.support.faults import fault_at
from tests.support.managers import drain, make_manager
from tests.support.tiny_models import make_tiny_model

GREEDY = SamplingParams(max_tokens=6)


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", vocab_size=49152)


def held_equal_to_references(cm) -> bool:
    held = cm.held_blocks()
    return all(cm.engine.blocks.blocks[b].ref_count == n for b, n in held.items())


def test_retry_of_a_chat_answer_replaces_it_and_greedy_gives_it_back(model):
    cm = make_manager(model)
    first = drain(cm.chat("tell me about rivers", GREEDY))
    again = drain(cm.retry(GREEDY))
    assert again.token_ids == first.token_ids and again.output_number == 2
    assert [o.output_number for o in cm.outputs()] == [2]  # output 1 was deleted
    turns = [cm.registry.chunks[i] for i in cm.turns]
    assert [t.role for t in turns] == [Role.USER, Role.OUTPUT] and turns[1].output_number == 2
    assert held_equal_to_references(cm)
    drain(cm.chat("and the sea?", GREEDY))  # the conversation goes on after the new answer
    assert len(cm.turns) == 4


def test_retry_of_an_inference_and_when_the_context_changed(model):
    cm = make_manager(model)
    with pytest.raises(ChunkError, match="nothing to retry"):
        cm.retry(GREEDY)
    cm.add_context("the cat sat on a mat")
    cm.set_query("where did the cat sit")
    first = drain(cm.infer(GREEDY))
    again = drain(cm.retry(GREEDY))
    assert again.text == first.text and [o.output_number for o in cm.outputs()] == [2]
    cm.set_query("what fell over the hills")
    with pytest.raises(ChunkError, match="context changed since output 2"):
        cm.retry(GREEDY)
    cm.use_output(2)
    cm.set_query("where did the cat sit")
    with pytest.raises(ChunkError, match="context changed"):
        cm.retry(GREEDY)  # output 2 is in the context now
    assert [o.output_number for o in cm.outputs()] == [2]  # a refused retry deleted nothing


def snapshot(cm) -> tuple:
    """What a refused or interrupted /retry must leave as it was: chunks, context, answers, pins."""
    chunks = [(c.chunk_id, c.role, c.text, c.output_number) for c in cm.registry.chunks.values()]
    pinned = sorted(
        (c.chunk_id, c.span.block_ids) for c in cm.registry.chunks.values() if c.span and c.span.pinned
    )
    return chunks, cm.system, list(cm.middle), list(cm.turns), cm.query, pinned


def conversation(model):
    """The issue's steps: a context, a query, /infer, then a chat message."""
    cm = make_manager(model)
    cm.add_context("the cat sat on a mat")
    cm.set_query("where did the cat sit")
    drain(cm.infer(GREEDY))
    drain(cm.chat("Hello there!", GREEDY))
    return cm


def test_a_refused_retry_loses_nothing(model):
    cm = conversation(model)
    before = snapshot(cm)
    with pytest.raises(CacheFullError, match="longer than the model's"):
        drain(cm.retry(SamplingParams(max_tokens=100_000)))
    assert snapshot(cm) == before and held_equal_to_references(cm)
    cm.engine.blocks.check_invariants()
    drain(cm.retry(GREEDY))  # and the same retry, within bounds, still works
    assert [o.output_number for o in cm.outputs()] == [1, 3] and len(cm.turns) == 2


@pytest.mark.parametrize("fault", [KeyboardInterrupt, RuntimeError])
def test_a_retry_interrupted_before_its_first_token_loses_nothing(model, fault):
    cm = conversation(model)
    before = snapshot(cm)
    with fault_at([(cm.engine, "compute")], at=1, fault=fault):  # Ctrl-C 1 ms into /retry, or a failure
        if fault is KeyboardInterrupt:
            result = drain(cm.retry(SamplingParams(max_tokens=6)))
            assert result.finish_reason == "cancelled" and result.output_number is None
        else:
            with pytest.raises(RuntimeError):
                drain(cm.retry(SamplingParams(max_tokens=6)))
    assert snapshot(cm) == before and held_equal_to_references(cm)
    cm.engine.blocks.check_invariants()


def test_a_retry_cancelled_after_its_first_token_replaces_the_answer(model):
    cm = conversation(model)
    stream = cm.retry(SamplingParams(max_tokens=50))
    while not isinstance(next(stream), GenerationStep):
        pass
    result = stream.throw(KeyboardInterrupt())
    assert result.finish_reason == "cancelled" and result.output_number == 3
    assert [o.output_number for o in cm.outputs()] == [1, 3] and len(cm.turns) == 2
    assert held_equal_to_references(cm)


def test_a_retry_may_take_the_room_of_the_answer_it_replaces(model):
    block_bytes = Engine(model, kv_memory_bytes=1 << 23, block_size=4, prefill_chunk=512).bytes_per_block
    cm = make_manager(model, kv_memory=block_bytes * 24)  # 96 tokens
    cm.set_query("count")
    params = SamplingParams(max_tokens=40, temperature=0)
    first = drain(cm.infer(params))
    assert first.output_number == 1
    again = drain(cm.retry(params))  # the prompt, 40 reserved, and output 1's pinned 40 would not fit
    assert again.output_number == 2 and [o.output_number for o in cm.outputs()] == [2]
    assert held_equal_to_references(cm)


def test_model_info_reads_the_model_and_the_pool():
    model = make_tiny_model("llama", vocab_size=49152)  # its own: an engine tiles its linears in place
    num_weights = sum(p.numel() for p in model.parameters())
    cm = make_manager(model, block_size=4, kv_memory=1 << 20)
    info = cm.model_info()
    assert info.family == "llama" and info.architecture == "LlamaForCausalLM"
    assert info.num_parameters == num_weights
    assert info.dtype == "fp32" and info.context_length == 8192 and info.device == "cpu"
    assert info.kv_tokens == cm.engine.blocks.num_blocks * 4 and info.kv_bytes <= 1 << 20
    tiled = kernels.fp32_linear() is not None
    assert info.batch_variance == cm.engine.batch_invariance
    assert (info.batch_variance is None) == tiled  # one order of sums for any rows: kvchat's linears
    assert info.chat_template.startswith("ChatML")
    assert info.quantization == ("none (fp32 on kvchat's kernel)" if tiled else "none")
    assert info.threads == torch.get_num_threads()


def test_ctx_size_gives_at_least_that_many_tokens_in_whole_blocks(model):
    loaded = types.SimpleNamespace(model=model, dtype=torch.float32)
    for ctx_size in (1, 100, 1000):
        cache = CacheSettings(ctx_size=ctx_size, block_size=16)
        engine = Engine(
            model, kv_memory_bytes=kv_memory_bytes(loaded, cache), block_size=16, prefill_chunk=512
        )
        num_tokens = engine.blocks.num_blocks * 16
        assert ctx_size <= num_tokens < ctx_size + 16
    assert kv_memory_bytes(loaded, CacheSettings(kv_memory_mb=3)) == 3 << 20  # unset: MiB decide


def test_compare_tells_each_mode_as_it_answers_and_compares_the_same(model):
    from kvchat.cli import cache_commands

    cm = make_manager(model)
    cm.add_context("the cat sat on a mat while rain fell")
    cm.set_query("where did the cat sit")
    drain(cm.infer(GREEDY))
    notes: list[str] = []
    told = cache_commands.compare_modes_told(cm, "", GREEDY, notes.append)
    assert notes[0] == "answering under exact, reposition, repair, greedily, up to 6 tokens each"
    assert [n.split(" answered")[0] for n in notes[1:]] == ["reposition", "repair", "exact"]  # exact last
    assert all(f"({i} of 3)" in n for i, n in enumerate(notes[1:], 1))
    untold = cache_commands.compare_modes_told(cm, "", GREEDY)
    assert [r.token_ids for r in told.results] == [r.token_ids for r in untold.results]


def test_notes_go_to_a_terminal_only(monkeypatch):
    import io

    from kvchat.cli.ui import UI

    err = io.StringIO()
    UI(err_file=err).note("working")
    assert err.getvalue() == ""  # not a terminal: scripts stay quiet
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich takes the file for a terminal
    UI(err_file=err).note("working")
    assert "working" in err.getvalue()
    err = io.StringIO()
    UI(err_file=err, json_lines=True).note("working")
    assert err.getvalue() == ""


@pytest.mark.parametrize("quantize", ["none", "int8", "int4"])
def test_model_info_counts_packed_and_quantized_weights_as_before(quantize):
    """Packed bf16 linears and quantized ones keep no weight parameter (UpcastLinear, where oneDNN takes
    no bf16, keeps its own); /info still counts each weight once, the tied output layer included once."""
    from kvchat.linears.bf16_linears import UpcastLinear
    from kvchat.models.info import num_weights
    from kvchat.models.quantize import quantize_model

    model = make_tiny_model("llama", dtype=torch.bfloat16)
    expected = sum(p.numel() for p in model.parameters())
    quantize_model(model, quantize)
    Engine(model, kv_memory_bytes=1 << 20, block_size=4, prefill_chunk=512)  # packs what it can
    if quantize != "none" or not any(isinstance(m, UpcastLinear) for m in model.modules()):
        assert sum(p.numel() for p in model.parameters()) < expected  # the count below has work to do
    assert num_weights(model) == expected
