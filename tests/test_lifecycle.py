"""An inference's lifetime: each way out of it (an answer, a failure, Ctrl-C in the prefill, in the
composition or while the turn is closed, a second stream beside it) leaves exactly what is kept."""

import signal

import pytest

from kvchat.chunks.context import ContextManager
from kvchat.chunks.inference import Inference
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import RepairStrategy, ReuseMode, Role
from kvchat.engine.engine import Engine
from kvchat.engine.records import GenerationStep
from kvchat.engine.sampling import SamplingParams
from kvchat.errors import CacheFullError, ChunkError, StateFileError
from tests.support.hf_tokenizers import load_qwen25_tokenizer
from tests.support.managers import GREEDY, assert_refs_match, drain, make_manager, repair, text
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", vocab_size=49152)


def manager_with_query(model, **kwargs):
    cm = make_manager(model, **kwargs)
    cm.set_system(text(0))
    cm.add_context(text(1, 30))
    cm.add_context(text(2, 30))
    cm.set_query("what fell over the hills?")
    return cm


def assert_all_free_after_reset(cm):
    cm.reset()
    blocks = cm.engine.blocks
    blocks.check_invariants()
    assert blocks.num_free == blocks.num_blocks and blocks.num_pinned == 0


def test_a_failing_inference_keeps_no_block(model):
    cm = manager_with_query(model)
    drain(cm.infer(GREEDY))
    with pytest.raises(ValueError, match="min_p"):
        drain(cm.infer(SamplingParams(min_p=1.0, temperature=1.0, max_tokens=4)))
    assert_refs_match(cm)
    assert_all_free_after_reset(cm)


def test_ctrl_c_in_a_reposition_prefill_is_a_clean_cancel(model, monkeypatch):
    cm = manager_with_query(model, mode=ReuseMode.REPAIR)
    cm.repair = repair(strategy=RepairStrategy.PREFIX)
    drain(cm.infer(GREEDY))
    cm.middle.reverse()  # the passages move: repair recomputes their first tokens while composing
    engine = cm.engine
    real = engine.compute
    calls = []

    def interrupted(seq, *args, **kwargs):
        calls.append(kwargs.get("until"))
        if kwargs.get("until") is not None:  # the composition's partial prefill, not the token loop's
            raise KeyboardInterrupt
        return real(seq, *args, **kwargs)

    monkeypatch.setattr(engine, "compute", interrupted)
    result = drain(cm.infer(GREEDY))
    assert calls and result.finish_reason == "cancelled" and result.output_number is None
    assert [o.output_number for o in cm.outputs()] == [1]
    assert_refs_match(cm)
    assert_all_free_after_reset(cm)


def test_a_second_ctrl_c_while_the_turn_closes_keeps_the_answer(model, monkeypatch):
    cm = manager_with_query(model)
    stream = cm.infer(SamplingParams(max_tokens=20))
    while not isinstance(next(stream), GenerationStep):
        pass
    engine, real = cm.engine, cm.engine.compute

    def compute_with_a_signal(seq, *args, **kwargs):
        signal.raise_signal(signal.SIGINT)  # delivered at once: the closing step must not stop
        return real(seq, *args, **kwargs)

    monkeypatch.setattr(engine, "compute", compute_with_a_signal)
    first = stream.throw(KeyboardInterrupt)  # the first Ctrl-C: stop generating, close the turn
    rest = list(stream)
    result = (rest or [first])[-1]
    assert result.finish_reason == "cancelled" and result.output_number == 1
    output = cm.outputs()[0]
    assert output.num_blocks > 0 and output.pinned
    assert_refs_match(cm)
    assert_all_free_after_reset(cm)


def test_two_interleaved_streams_leak_nothing(model):
    cm = manager_with_query(model)
    a, b = cm.infer(SamplingParams(max_tokens=5)), cm.chat("and then?", SamplingParams(max_tokens=5))
    next(a), next(b), next(a)
    *_, result_b = b
    *_, result_a = a
    assert {result_a.output_number, result_b.output_number} == {1, 2}
    assert cm.live is not None and len(cm.outputs()) == 2
    assert_refs_match(cm)
    assert_all_free_after_reset(cm)


@pytest.mark.parametrize("in_prefill,finish", [(True, False), (False, False), (False, True)])
def test_a_chat_stream_ended_after_a_reset_leaves_the_new_session_alone(model, in_prefill, finish):
    cm = manager_with_query(model)
    stream = cm.chat("and then?", SamplingParams(max_tokens=5))
    event = next(stream)
    while not in_prefill and not isinstance(event, GenerationStep):  # on to the first token
        event = next(stream)
    cm.reset()
    if finish:
        *_, result = stream
        assert result.output_number is None
    else:
        stream.close()  # its turn went with the reset: nothing to take back, and no KeyError
    assert cm.outputs() == [] and cm.turns == [] and cm.live is None  # the new session got nothing
    assert cm.engine.blocks.num_free == cm.engine.blocks.num_blocks
    assert_refs_match(cm)


def test_a_load_that_does_not_fit_changes_nothing(model, tmp_path):
    big = manager_with_query(model)
    big.add_context(text(5, 90))
    drain(big.infer(GREEDY))
    big.save(tmp_path / "big.safetensors")
    block_bytes = big.engine.bytes_per_block
    small = manager_with_query(model, kv_memory=block_bytes * 40)
    drain(small.infer(SamplingParams(max_tokens=2)))
    before = [c.chunk_id for c in small.context_chunks()], small.engine.blocks.num_free
    with pytest.raises(StateFileError, match="needs .* KV blocks"):
        small.load(tmp_path / "big.safetensors")
    assert ([c.chunk_id for c in small.context_chunks()], small.engine.blocks.num_free) == before
    assert len(small.outputs()) == 1
    assert_refs_match(small)


def test_equal_answers_are_outputs_of_their_own(model):
    cm = manager_with_query(model)
    first, second = drain(cm.infer(GREEDY)), drain(cm.infer(GREEDY))
    assert first.token_ids == second.token_ids
    assert (first.output_number, second.output_number) == (1, 2) and first.chunk_id != second.chunk_id
    assert [o.output_number for o in cm.outputs()] == [1, 2]
    cm.use_output(1)
    cm.use_output(2)
    places = [c.place for c in cm.context() if c.role is Role.OUTPUT]
    assert places == [4, 5]
    assert_refs_match(cm)


def test_equal_chat_turns_each_have_their_place(model):
    cm = make_manager(model)
    drain(cm.chat("hello", SamplingParams(max_tokens=3)))
    drain(cm.chat("hello", SamplingParams(max_tokens=3)))
    turns = [c for c in cm.context() if c.role is Role.USER]
    assert len(turns) == 2 and turns[0].chunk_id != turns[1].chunk_id
    assert [t.place for t in turns] == [2, 4]


def test_per_chunk_rows_add_up_to_the_totals(model):
    cm = manager_with_query(model)
    for _ in range(2):
        result = drain(cm.infer(GREEDY))
        assert sum(r.num_computed for r in result.chunks) == result.computed_tokens
        assert sum(r.num_reused for r in result.chunks) == result.reused_tokens
        assert sum(r.num_tokens for r in result.chunks) == result.prompt_tokens
        assert result.chunks[-1].chunk_id is None and result.chunks[-1].role is None  # the answer prompt


def test_a_cancelled_prefill_reports_what_it_computed(model):
    cm = manager_with_query(model)  # prefill_chunk 16: the prompt takes several pieces
    stream = cm.infer(GREEDY)
    next(stream)
    result = stream.throw(KeyboardInterrupt)
    assert result.finish_reason == "cancelled" and result.output_number is None and result.token_ids == []
    assert 0 < result.computed_tokens < result.prompt_tokens
    assert sum(r.num_computed for r in result.chunks) == result.computed_tokens
    assert_refs_match(cm)


def test_cache_full_message_counts_free_blocks_before_the_refusal(model):
    block_bytes = make_manager(model).engine.bytes_per_block
    cm = make_manager(model, kv_memory=block_bytes * 40)
    cm.set_query(text(3, 40))
    drain(cm.infer(SamplingParams(max_tokens=8)))  # output 1 is pinned
    cm.add_context(text(4, 60))
    with pytest.raises(CacheFullError) as err:
        drain(cm.infer(SamplingParams(max_tokens=60)))
    message = str(err.value)
    assert "delete-output 1" in message
    if "more blocks needed" in message:
        needed, free = (int(w) for w in message.split(":")[1].split() if w.isdigit())
        assert needed > free
    assert_refs_match(cm)


def test_dropping_the_default_system_prompt_says_what_it_is(model):
    tokenizer = load_qwen25_tokenizer()
    qwen = make_tiny_model("qwen2", vocab_size=len(tokenizer))
    engine = Engine(qwen, kv_memory_bytes=1 << 22, block_size=16, prefill_chunk=512)
    cm = ContextManager(engine, ChatFormat(tokenizer), tokenizer, frozenset({151645, 151643}))
    cm.set_query("hi")
    default = cm.context_chunks()[0]
    with pytest.raises(ChunkError, match="default system prompt.*/system"):
        cm.drop(str(default.number))


def test_a_context_longer_than_the_model_positions_is_refused(model):
    cm = manager_with_query(model)
    limit = model.config.max_position_embeddings
    with pytest.raises(CacheFullError, match=f"model's {limit} positions"):
        drain(cm.infer(SamplingParams(max_tokens=limit)))
    assert_refs_match(cm)


@pytest.mark.parametrize("mode", list(ReuseMode))
def test_leaving_an_inference_frees_exactly_what_it_did_not_hand_over(model, mode):
    cm = manager_with_query(model, mode=mode)
    drain(cm.infer(GREEDY))
    cm.middle.reverse()  # the passages move: reposition and repair copy their KV into new blocks
    blocks = cm.engine.blocks
    before = blocks.num_free
    with pytest.raises(KeyboardInterrupt), Inference(cm.setup, cm.placement()) as run:
        run.compose(reserve_tokens=8)
        assert blocks.num_free < before
        raise KeyboardInterrupt
    assert blocks.num_free == before and run.composed is not None and run.composed.seq.block_table == []
    with Inference(cm.setup, cm.placement()) as run:
        seq = run.compose(reserve_tokens=8).seq
        kept = run.hand_over()
    assert kept is seq and seq.block_table and blocks.num_free < before
    cm.engine.free(seq)
    assert blocks.num_free == before
    assert_refs_match(cm)


def test_a_verify_without_room_for_its_full_copy_keeps_nothing(model):
    block_bytes = make_manager(model).engine.bytes_per_block
    cm = manager_with_query(model, kv_memory=block_bytes * 48)
    drain(cm.infer(SamplingParams(max_tokens=4)))
    cm.add_context(text(5, 40))  # the context now fits once, not twice
    free = cm.engine.blocks.num_free
    with pytest.raises(CacheFullError, match="second, fully recomputed copy.*delete-output 1"):
        cm.verify(4)
    assert cm.engine.blocks.num_free == free
    assert_refs_match(cm)
    assert_all_free_after_reset(cm)
