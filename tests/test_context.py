"""The ContextManager on a tiny random model with the real SmolLM2 tokenizer and chat template."""

import random

import pytest
import torch

from kvchat.chunks.compose import RepairPolicy
from kvchat.chunks.context import ContextManager
from kvchat.chunks.types import InferenceResult, RepairStrategy, ReuseMode, Role
from kvchat.engine.engine import Engine
from kvchat.engine.generate import PrefillProgress
from kvchat.engine.records import GenerationStep
from kvchat.engine.sampling import SamplingParams
from kvchat.errors import CacheFullError, ChunkError, StateFileError
from tests.support.managers import GREEDY, drain, make_manager, text, tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def full_last_logits(model, token_ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([token_ids])).logits[0, -1]


def composed_logits(cm):
    composed = cm.compose()
    logits = cm.engine.compute(composed.seq)
    tokens = list(composed.seq.token_ids)
    cm.engine.free(composed.seq)
    return logits, tokens, composed


def test_exact_mode_equals_full_recompute_across_compositions(model):
    cm = make_manager(model)
    cm.set_system(text(0))
    docs = [cm.add_context(text(i, 10 + i)).chunk_id for i in range(1, 5)]
    cm.set_query("what fell over the hills?")
    rng = random.Random(0)
    for _ in range(6):
        cm.middle = rng.sample(docs, rng.randint(1, len(docs)))  # reordered and dropped chunks
        logits, tokens, composed = composed_logits(cm)
        assert (logits - full_last_logits(model, tokens)).abs().max() <= 1e-4
        assert composed.num_repositioned == 0
    assert cm.engine.blocks.hit_tokens > 0


def test_chat_turns_compute_only_new_tokens(model):
    # Each turn renders the conversation anew; what it shares with the last turn's sequence (its prompt,
    # and its answer as far as the answer's text tokenizes back to the ids generated: this random model
    # answers in newlines, which merge with the "assistant\n" header) is reused, partial last block
    # included, and only the rest is computed.
    cm = make_manager(model)
    cm.set_system("You are terse.")
    previous: list[int] = []
    previous_prompt_tokens = 0
    for turn in range(4):
        result = drain(cm.chat(text(10 + turn, 6), GREEDY))
        assert cm.live is not None
        prompt = cm.live.token_ids[: result.prompt_tokens]
        shared = next(
            (i for i, (a, b) in enumerate(zip(previous, prompt, strict=False)) if a != b),
            min(len(previous), len(prompt)),
        )
        if turn:
            assert shared > previous_prompt_tokens // 2
            assert result.reused_tokens == shared
            assert result.computed_tokens == result.prompt_tokens - shared
        previous, previous_prompt_tokens = list(cm.live.token_ids), result.prompt_tokens
    assert [c.role for c in cm.context_chunks()][-2:] == [Role.USER, Role.OUTPUT]


def test_outputs_are_retained_pinned_and_released(model):
    cm = make_manager(model)
    cm.set_query("say something")
    result = cm.infer_blocking(GREEDY)
    assert result.output_number == 1
    (out,) = cm.outputs()
    assert out.pinned and out.num_blocks > 0
    assert cm.stats().num_pinned >= out.num_blocks
    cm.use_output(1)
    assert cm.context()[-2].output_number == 1  # outputs sit before the query
    cm.delete_output(1)
    assert cm.outputs() == [] and cm.stats().num_pinned == 0
    with pytest.raises(ChunkError):
        cm.use_output(1)
    cm.reset()
    cm.engine.blocks.check_invariants()
    assert cm.engine.blocks.num_free == cm.engine.blocks.num_blocks


def test_reposition_and_repair_move_chunks_and_report_them(model):
    reports = {}
    for mode in (ReuseMode.EXACT, ReuseMode.REPOSITION, ReuseMode.REPAIR):
        cm = make_manager(model, mode=mode)
        cm.repair = RepairPolicy(share=0.25, min_tokens=2, strategy=RepairStrategy.PREFIX, taper=0.0)
        cm.set_system("first system prompt")
        doc = cm.add_context(text(3, 30))
        cm.set_query("what ran to the sea?")
        drain(cm.infer(GREEDY))
        cm.set_system("a different and longer system prompt")  # every later position shifts
        result = drain(cm.infer(GREEDY))
        reports[mode] = next(r for r in result.chunks if r.chunk_id == doc.chunk_id)
    assert reports[ReuseMode.EXACT].num_computed == reports[ReuseMode.EXACT].num_tokens
    assert reports[ReuseMode.REPOSITION].num_repositioned == reports[ReuseMode.REPOSITION].num_tokens
    repair = reports[ReuseMode.REPAIR]
    assert (
        0 < repair.num_computed < repair.num_tokens
        and repair.num_repositioned == repair.num_tokens - repair.num_computed
    )


def answered_then_moved(model) -> ContextManager:
    """A passage answered once, then under a longer system prompt: every later position shifts."""
    cm = make_manager(model)
    cm.set_system("first system prompt")
    cm.add_context(text(4, 30))
    cm.set_query("what ran to the sea?")
    drain(cm.infer(GREEDY))
    cm.set_system("another system prompt, longer than the first one")
    return cm


def test_verify_exact_is_identical_and_reposition_is_measured(model):
    cm = answered_then_moved(model)
    cm.mode = ReuseMode.REPOSITION
    moved = cm.verify(8)
    assert moved.repositioned_tokens > 0 and moved.max_logit_diff > 0
    assert not moved.identical and moved.first_difference == 0
    cm.mode = ReuseMode.EXACT
    exact = cm.verify(8)
    assert exact.kl_divergence < 1e-6 and exact.top1_agree and exact.top1_rate == 1.0
    if cm.engine.batch_invariance is None:  # kvchat's kernels built: the same bits
        assert exact.identical and exact.kl_divergence == 0 and exact.max_logit_diff == 0
    assert exact.greedy_agree == exact.greedy_tokens
    assert exact.repositioned_tokens == 0
    cm.engine.blocks.check_invariants()


def test_verify_leaves_the_cache_as_it_found_it(model):
    cm = answered_then_moved(model)
    cm.mode = ReuseMode.REPOSITION
    blocks = cm.engine.blocks

    def cached_after(action) -> int:
        before = blocks.num_cached
        action()
        return blocks.num_cached - before

    def compose_only():
        composed = cm.compose()
        cm.engine.compute(composed.seq)
        cm.engine.free(composed.seq)

    compose_only()  # what the mode computes exactly itself (the new system prompt) stays cached
    results = []
    assert cached_after(lambda: results.append(cm.verify(8))) == cached_after(compose_only)
    first = results[0]
    second = cm.verify(8)  # measures the mode again, not the first one's full recompute
    assert first.repositioned_tokens > 0 and second == first
    cm.engine.blocks.check_invariants()


def test_cancel_keeps_generated_tokens(model):
    cm = make_manager(model)
    cm.set_query("count")
    stream = cm.infer(SamplingParams(max_tokens=50))
    while not isinstance(next(stream), GenerationStep):  # past the prefill, to the first token
        pass
    result = stream.throw(KeyboardInterrupt())
    assert isinstance(result, InferenceResult) and result.finish_reason == "cancelled"
    assert 1 <= len(result.token_ids) < 50 and cm.outputs()[0].num_tokens > len(result.token_ids)
    cm.engine.blocks.check_invariants()


def test_budget_refuses_oversized_chunks_and_keeps_state(model):
    block_bytes = Engine(model, kv_memory_bytes=1 << 23, block_size=4, prefill_chunk=512).bytes_per_block
    cm = make_manager(model, kv_memory=block_bytes * 16)  # 64 tokens
    with pytest.raises(CacheFullError):
        cm.add_context(text(5, 200))
    cm.set_query("hi")
    drain(cm.infer(SamplingParams(max_tokens=4)))
    kept = [(o.chunk_id, o.num_tokens, o.num_blocks, o.pinned) for o in cm.outputs()]
    cm.set_query(text(6, 15))
    with pytest.raises(CacheFullError, match="delete-output 1"):
        drain(cm.infer(SamplingParams(max_tokens=12)))
    assert [(o.chunk_id, o.num_tokens, o.num_blocks, o.pinned) for o in cm.outputs()] == kept


def test_save_load_round_trip(model, tmp_path):
    cm = make_manager(model)
    cm.set_system("You are terse.")
    cm.add_context(text(7, 20))
    cm.set_query("what sat on the mat?")
    first = drain(cm.infer(GREEDY))
    cm.save(tmp_path / "state.safetensors")
    fresh = make_manager(model)
    assert fresh.load(tmp_path / "state.safetensors") == len(cm.chunks())
    again = drain(fresh.infer(GREEDY))
    assert again.token_ids == first.token_ids
    assert again.computed_tokens == 1  # only the last prompt token, for its logits
    kept = [c.chunk_id for c in cm.outputs()]
    assert [c.chunk_id for c in fresh.outputs()][: len(kept)] == kept
    assert again.output_number == len(kept) + 1  # an equal answer is still an output of its own


def test_load_refuses_mismatched_and_truncated_files(model, tmp_path):
    cm = make_manager(model)
    cm.set_query("hello there")
    drain(cm.infer(GREEDY))
    path = tmp_path / "s.safetensors"
    cm.save(path)
    other = make_manager(model, block_size=8)
    other.set_query("keep me")
    with pytest.raises(StateFileError, match="made with blocks of 4 tokens; this session has blocks of 8"):
        other.load(path)
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(StateFileError):
        other.load(tmp_path / "cut.safetensors")
    assert other.chunk(other.query).info.text == "keep me"


def test_reposition_moves_reordered_chunks_even_when_their_header_is_cached(model):
    cm = make_manager(model, mode=ReuseMode.REPOSITION)
    cm.set_system("system prompt")
    docs = [cm.add_context(text(20 + i, 25)).chunk_id for i in range(3)]
    cm.set_query("which came first?")
    drain(cm.infer(GREEDY))
    cm.middle = docs[::-1]  # each passage starts with the same user header, which the prefix matches
    result = drain(cm.infer(GREEDY))
    moved = [r for r in result.chunks if r.role is Role.CONTEXT]
    assert all(r.num_computed == 0 and r.num_reused + r.num_repositioned == r.num_tokens for r in moved)


def test_refused_chat_turn_changes_nothing(model):
    block_bytes = Engine(model, kv_memory_bytes=1 << 23, block_size=4, prefill_chunk=512).bytes_per_block
    cm = make_manager(model, kv_memory=block_bytes * 16)
    before = [c.chunk_id for c in cm.context_chunks()]
    with pytest.raises(CacheFullError):
        cm.chat_blocking(text(8, 10), SamplingParams(max_tokens=60))
    assert [c.chunk_id for c in cm.context_chunks()] == before and cm.turns == []


def test_long_prompt_reports_prefill_progress_and_cancels_between_pieces(model):
    cm = make_manager(model)  # prefill pieces of 16 tokens
    cm.add_context(text(30, 60))
    cm.set_query("what fell?")
    stream = cm.infer(GREEDY)
    first = next(stream)
    assert isinstance(first, PrefillProgress) and first.done == 16 and first.total > 32
    result = stream.throw(KeyboardInterrupt())
    assert result.finish_reason == "cancelled" and result.token_ids == [] and result.output_number is None
    assert result.computed_tokens == 16 < result.prompt_tokens  # what it did, not what it planned
    assert cm.outputs() == []
    cm.engine.blocks.check_invariants()
    again = cm.infer_blocking(GREEDY)
    assert again.reused_tokens >= 16  # what the cancelled prefill computed stays cached


def test_a_tiny_temperature_answers_greedily_and_resolved_settings_name_the_model(model):
    # Once an IndexError (id == vocabulary size) that left blocks held.
    cm = make_manager(model)
    cm.set_query(text(3))
    greedy = cm.infer_blocking(GREEDY)
    cm.reset()
    cm.set_query(text(3))
    tiny = cm.infer_blocking(SamplingParams(max_tokens=8, temperature=1e-40, seed=0))
    assert tiny.token_ids == greedy.token_ids
    resolved = cm.resolved_settings()
    assert resolved["model.model"] == "tiny" and resolved["model.dtype"] == "fp32"
    assert resolved["model.device"] == "cpu" and int(resolved["model.threads"]) >= 1
