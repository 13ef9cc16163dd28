"""Speculative decoding with a draft model, the real SmolLM2, and how the stats reach the user."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvchat.chunks.types import InferenceResult, ReuseMode
from kvchat.cli.jsonout import _inference_fields
from kvchat.cli.views import inference_line
from kvchat.engine.detokenizer import StreamDetokenizer
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.speculate import NO_SPECULATION, Speculation
from kvchat.errors import DraftModelError
from kvchat.session import check_draft_vocabulary
from tests.support.speculation import block_state, repeating_prompt, run, varied_model


@pytest.mark.parametrize("draft_seed", [0, 7])  # the target itself (all accepted), another model
def test_draft_model_greedy_equals_plain(draft_seed):
    target = varied_model("llama", seed=0)
    draft = varied_model("qwen2", seed=draft_seed) if draft_seed else target
    prompt = repeating_prompt(6)
    plain = run(target, prompt)
    draft_engine = Engine(draft, kv_memory_bytes=1 << 20, block_size=4, prefill_chunk=512)
    spec = run(target, prompt, Speculation("draft", 5, draft_engine))
    assert [s.token_id for s in spec[0]] == [s.token_id for s in plain[0]]
    assert spec[1:] == plain[1:]
    stats = spec[0][-1].stats
    assert stats.drafted_tokens > 0
    if not draft_seed:
        assert stats.accepted_tokens == stats.drafted_tokens
    draft_engine.blocks.check_invariants()
    assert draft_engine.blocks.num_used == 0  # the draft sequence was freed with the generation


def test_draft_model_reuses_its_cached_prefix():
    target = varied_model("llama", seed=0)
    draft_engine = Engine(
        varied_model("llama", seed=5), kv_memory_bytes=1 << 20, block_size=4, prefill_chunk=512
    )
    speculation = Speculation("draft", 4, draft_engine)
    prompt = repeating_prompt(7)
    run(target, prompt, speculation)
    computed = []
    compute = draft_engine.compute

    def counting(seq, *args, **kwargs):
        computed.append(seq.num_tokens - seq.num_computed)
        return compute(seq, *args, **kwargs)

    draft_engine.compute = counting  # type: ignore[method-assign]
    run(target, prompt, speculation)
    assert computed[0] < 4  # the second answer's prompt comes from the draft cache, not a new prefill


def test_draft_mode_needs_a_draft_model_and_the_same_vocabulary():
    with pytest.raises(DraftModelError):
        Speculation("draft", 4)
    main = SimpleNamespace(model_id="main", tokenizer=_Tok({"a": 0, "b": 1}))
    other = SimpleNamespace(model_id="draft", tokenizer=_Tok({"a": 0, "c": 1}))
    check_draft_vocabulary(main, SimpleNamespace(model_id="same", tokenizer=_Tok({"a": 0, "b": 1})))
    with pytest.raises(DraftModelError, match="vocabulary"):
        check_draft_vocabulary(main, other)


class _Tok:
    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def __len__(self) -> int:
        return len(self.vocab)


@pytest.mark.slow
def test_prompt_lookup_on_smollm2_equals_plain_greedy(smollm2):
    model, tokenizer = smollm2
    passage = "The keeper climbed the one hundred and twelve steps, trimmed the wick and lit the lamp."
    messages = [{"role": "user", "content": f"Repeat this sentence word for word: {passage}"}]
    prompt = list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    )
    answers = []
    for speculation in (None, Speculation("prompt-lookup", 8)):
        engine = Engine(model, kv_memory_bytes=64 << 20, block_size=16, prefill_chunk=512)
        seq = engine.start(prompt)
        params = SamplingParams(max_tokens=40)
        steps = list(generate(engine, seq, params, frozenset({2}), StreamDetokenizer(tokenizer), speculation))
        engine.free(seq)
        answers.append(([s.token_id for s in steps], "".join(s.text for s in steps), block_state(engine)))
        accepted = steps[-1].stats.accepted_tokens
    assert answers[1] == answers[0]
    assert accepted > 10
    assert passage[:30] in answers[0][1]  # it did copy, so drafts were accepted


def test_stats_reach_the_info_line_and_json():
    result = InferenceResult("hi", [1, 2], "stop", 1, "c1", ReuseMode.EXACT, 5, 0, 0, 5, 0.1, 10.0, 20.0)
    assert "accepted" not in inference_line(result).plain
    result = InferenceResult(
        "hi",
        [1, 2],
        "stop",
        1,
        "c1",
        ReuseMode.EXACT,
        5,
        0,
        0,
        5,
        0.1,
        10.0,
        20.0,
        drafted_tokens=8,
        accepted_tokens=6,
    )
    assert "drafts 75% accepted (6/8)" in inference_line(result).plain
    fields = json.loads(json.dumps(_inference_fields(result), default=list))
    assert fields["drafted_tokens"] == 8 and fields["accepted_tokens"] == 6


@pytest.mark.slow
def test_speculative_answers_equal_plain_through_the_context_manager(smollm2):
    from kvchat.chunks.context import ContextManager
    from kvchat.chunks.template import ChatFormat

    model, tokenizer = smollm2
    results = []
    for speculation in (NO_SPECULATION, Speculation("prompt-lookup", 8)):
        engine = Engine(model, kv_memory_bytes=64 << 20, block_size=16, prefill_chunk=512)
        cm = ContextManager(engine, ChatFormat(tokenizer), tokenizer, frozenset({2}), speculation=speculation)
        cm.add_context("Paris is the capital of France. Berlin is the capital of Germany.")
        records = list(cm.chat("Copy the first sentence of the text above.", SamplingParams(max_tokens=24)))
        result = records[-1]
        assert isinstance(result, InferenceResult)
        engine.blocks.check_invariants()
        results.append(result)
    assert results[1].token_ids == results[0].token_ids and results[1].text == results[0].text
    assert results[0].drafted_tokens == 0 and results[1].accepted_tokens > 0


def test_speculation_settings_are_checked_and_set_live():
    from kvchat.cli.commands import Status
    from kvchat.config import load_settings, replace_setting
    from kvchat.errors import ConfigError
    from tests.support.cli_harness import make_harness

    assert (
        load_settings(None, {"decode": {"speculate": "prompt-lookup", "draft_max": 4}}).decode.draft_max == 4
    )
    with pytest.raises(ConfigError):
        replace_setting(load_settings(None, {}), "decode.speculate", "sometimes")
    h = make_harness()
    assert h.run("/set decode.speculate prompt-lookup") is Status.OK
    assert h.ctx.speculation.mode == "prompt-lookup"
    assert h.run("/set draft_max 3") is Status.OK
    assert h.ctx.speculation.draft_max == 3
    assert h.run("/set decode.speculate draft") is not Status.OK  # no draft model loaded
    assert "draft model" in h.take()
    assert h.ctx.speculation.mode == "prompt-lookup" and h.shell.settings.decode.speculate == "prompt-lookup"
