"""Speculative decoding: the same tokens (greedy) or the same distribution (sampled) as the plain loop,
and the same block manager state afterwards, whatever the drafts and wherever generation stops."""

from __future__ import annotations

import pytest
import torch

from kvchat.engine.detokenizer import StreamDetokenizer
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate
from kvchat.engine.records import GenerationStep
from kvchat.engine.sampling import Sampler, SamplingParams, make_sampler
from kvchat.engine.speculate import Speculation
from tests.support.speculation import (
    CharTokenizer,
    EveryMatch,
    Scripted,
    ScriptedDrafter,
    block_state,
    repeating_prompt,
    run,
    varied_model,
)
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model():
    return varied_model()


def test_a_seeded_sampled_answer_with_drafts_is_the_same_every_run(model):
    # What is drafted decides how the sampler's random draws are spent, so it must follow the tokens.
    params = SamplingParams(temperature=0.9, top_k=8, max_tokens=60, seed=7)
    runs = [run(model, repeating_prompt(4), EveryMatch(), params)[0] for _ in range(3)]
    answers = [[step.token_id for step in steps] for steps in runs]
    assert answers[0] == answers[1] == answers[2]
    assert runs[0][-1].stats.drafted_tokens > 0


def test_the_draft_budget_weighs_verification_at_the_sequences_length(monkeypatch):
    asked: list[int] = []
    real_cost = Engine.verify_cost

    def recording(engine, num_drafts, context=0):
        asked.append(context)
        return real_cost(engine, num_drafts, context)

    monkeypatch.setattr(Engine, "verify_cost", recording)
    prompt = repeating_prompt(4)
    bf16 = make_tiny_model("llama", vocab_size=64, dtype=torch.bfloat16)  # drafts after any match
    steps, (token_ids, *_), _ = run(bf16, prompt, Speculation("prompt-lookup", 6))
    assert steps[-1].stats.drafted_tokens > 0
    assert asked[0] == len(prompt)  # which match pays, decided before the first token
    assert asked[1:] == sorted(asked[1:]) and len(prompt) < asked[-1] <= len(token_ids)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_prompt_lookup_greedy_equals_plain(kind):
    model = varied_model(kind, seed=1)
    prompt = repeating_prompt(1)
    plain = run(model, prompt)
    spec = run(model, prompt, EveryMatch())
    assert [s.token_id for s in spec[0]] == [s.token_id for s in plain[0]]
    assert "".join(s.text for s in spec[0]) == "".join(s.text for s in plain[0])
    assert spec[1:] == plain[1:]
    assert spec[0][-1].stats.drafted_tokens > 0


@pytest.mark.parametrize("wrong_share", [0.0, 0.2, 0.5])
def test_scripted_drafts_greedy_equal_plain_and_leave_the_same_blocks(model, wrong_share):
    prompt = repeating_prompt(2)
    plain = run(model, prompt)
    answer = [s.token_id for s in plain[0]]
    spec = run(model, prompt, Scripted(ScriptedDrafter(len(prompt), answer, wrong_share)))
    assert [s.token_id for s in spec[0]] == answer
    assert spec[1:] == plain[1:]
    stats = spec[0][-1].stats
    assert stats.accepted_tokens > 0
    assert (stats.accepted_tokens == stats.drafted_tokens) == (wrong_share == 0.0)


@pytest.mark.parametrize("shift", [0, 1, 2, 3])  # the answer's end falls at each place in a block
def test_drafts_evict_no_cached_block_a_plain_run_keeps(model, shift):
    prompt = repeating_prompt(8)
    filler = [(7 * i) % 64 for i in range(160)]  # 40 blocks: the whole pool
    kv_memory = 40 * Engine(model, kv_memory_bytes=1 << 20, block_size=4, prefill_chunk=512).bytes_per_block
    params = SamplingParams(max_tokens=50)
    answer = [s.token_id for s in run(model, prompt, params=params)[0]]
    cut = next(i for i in range(8 + shift, 50, 4) if answer[i] not in answer[:i])
    eos = frozenset({answer[cut]})
    plain = run(model, prompt, params=params, eos=eos, kv_memory=kv_memory, filler=filler)
    drafter = ScriptedDrafter(len(prompt), answer, 0.0)  # drafts run on past the end of the answer
    spec = run(model, prompt, Scripted(drafter, 8), params, eos, kv_memory=kv_memory, filler=filler)
    assert [s.token_id for s in spec[0]] == answer[: cut + 1]
    assert spec[1:] == plain[1:]
    assert spec[0][-1].stats.accepted_tokens > 0


@pytest.mark.parametrize("cut", [1, 2, 7, 13, 30])
def test_eos_stop_string_and_max_tokens_cut_an_accepted_run(model, cut):
    prompt = repeating_prompt(3)
    answer = [s.token_id for s in run(model, prompt)[0]]
    drafter = lambda: Scripted(ScriptedDrafter(len(prompt), answer, 0.0), draft_max=8)  # noqa: E731
    cases = [
        (SamplingParams(max_tokens=cut), frozenset()),
        (SamplingParams(max_tokens=60, stop=(f"<{answer[cut - 1]}>",)), frozenset()),
        (SamplingParams(max_tokens=60), frozenset({answer[cut - 1]})),
    ]
    for params, eos in cases:
        plain = run(model, prompt, params=params, eos=eos)
        spec = run(model, prompt, drafter(), params=params, eos=eos)
        assert [(s.token_id, s.text, s.finish_reason) for s in spec[0]] == [
            (s.token_id, s.text, s.finish_reason) for s in plain[0]
        ]
        assert spec[1:] == plain[1:]


def test_closing_inside_an_accepted_run_keeps_what_was_yielded(model):
    prompt = repeating_prompt(4)
    answer = [s.token_id for s in run(model, prompt)[0]]
    engines = []
    for speculation in (None, Scripted(ScriptedDrafter(len(prompt), answer, 0.0), draft_max=8)):
        engine = Engine(model, kv_memory_bytes=1 << 20, block_size=4, prefill_chunk=512)
        seq = engine.start(prompt)
        detokenizer = StreamDetokenizer(CharTokenizer())
        steps = generate(engine, seq, SamplingParams(max_tokens=60), frozenset(), detokenizer, speculation)
        got = [next(steps).token_id for _ in range(11)]  # the second run of drafts is partly yielded
        steps.close()
        assert got == answer[:11] and seq.token_ids == prompt + got
        assert seq.num_computed == seq.num_tokens - 1
        engine.blocks.check_invariants()
        engines.append((seq.num_recorded, seq.block_table, block_state(engine)))
    assert engines[0] == engines[1]


@pytest.mark.parametrize("where", ["forward", "verify"])
def test_interrupt_during_verification_leaves_the_sequence_as_yielded(model, monkeypatch, where):
    prompt = repeating_prompt(5)
    answer = [s.token_id for s in run(model, prompt)[0]]
    plain = Engine(model, kv_memory_bytes=1 << 20, block_size=4, prefill_chunk=512)
    plain_seq = plain.start(prompt)
    steps = generate(
        plain, plain_seq, SamplingParams(max_tokens=60), frozenset(), StreamDetokenizer(CharTokenizer())
    )
    next(steps)
    steps.close()  # the plain run stopped after its first token

    engine = Engine(model, kv_memory_bytes=1 << 20, block_size=4, prefill_chunk=512)
    seq = engine.start(prompt)
    if where == "forward":
        compute = engine.compute

        def interrupted(seq, all_logits=False, until=None, record=True):
            logits = compute(seq, all_logits, until, record)
            if all_logits:
                raise KeyboardInterrupt  # the forward ran, then Ctrl-C landed
            return logits

        monkeypatch.setattr(engine, "compute", interrupted)
    else:

        def verify(self, logits, seen_ids, draft_id):
            raise KeyboardInterrupt

        monkeypatch.setattr(Sampler, "verify", verify)
    speculation = Scripted(ScriptedDrafter(len(prompt), answer, 0.0))
    got: list[GenerationStep] = []
    with pytest.raises(KeyboardInterrupt):
        for step in generate(
            engine,
            seq,
            SamplingParams(max_tokens=60),
            frozenset(),
            StreamDetokenizer(CharTokenizer()),
            speculation,
        ):
            got.append(step)
    assert [s.token_id for s in got] == answer[:1]
    assert seq.token_ids == plain_seq.token_ids == prompt + answer[:1]
    assert (seq.num_computed, seq.num_recorded, seq.block_table) == (
        plain_seq.num_computed,
        plain_seq.num_recorded,
        plain_seq.block_table,
    )
    engine.blocks.check_invariants()
    assert block_state(engine) == block_state(plain)


SAMPLED = [
    SamplingParams(temperature=0.8, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.5),
]


@pytest.mark.slow  # statistical: many draws per case
@pytest.mark.parametrize("params", SAMPLED)
@pytest.mark.parametrize("draft", [0, 2, 5])  # the likeliest token, a middling one, one filtered out
def test_verify_draws_exactly_what_the_sampler_draws(params, draft):
    from scipy.stats import chisquare  # seconds to import: the fast lane has no statistical test

    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -3.0])  # (V,)
    seen = torch.tensor([1, 3])  # (T,)
    sampler = make_sampler(params)
    expected = sampler.process(logits, seen).softmax(-1)  # (V,)
    draws = 4000
    counts = torch.zeros(6)
    for seed in range(draws):
        sampler.generator.manual_seed(seed)
        counts[sampler.verify(logits, seen, draft)] += 1
    kept = expected > 0
    assert counts[~kept].sum() == 0
    assert chisquare(counts[kept].numpy(), expected[kept].numpy() * draws).pvalue > 1e-3


class ConstantDrafter:
    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        return [3] * max_tokens

    def close(self) -> None:
        pass


@pytest.mark.slow
def test_sampled_generation_has_the_plain_distribution():
    from scipy.stats import chi2_contingency

    model = make_tiny_model("llama", vocab_size=8, seed=3)
    with torch.no_grad():
        model.model.norm.weight.mul_(40.0)  # peaked next-token distributions, not near uniform
    prompt = [1, 2, 3, 4, 5]
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=4, seed=seed) for seed in range(600)]
    tables = []
    for speculation in (None, Scripted(ConstantDrafter(), draft_max=3)):
        engine = Engine(model, kv_memory_bytes=1 << 20, block_size=4, prefill_chunk=512)
        counts = torch.zeros(3, 8 * 8)
        for p in params:
            seq = engine.start(prompt)
            ids = [
                s.token_id
                for s in generate(
                    engine, seq, p, frozenset(), StreamDetokenizer(CharTokenizer()), speculation
                )
            ]
            engine.free(seq)
            for i in range(3):
                counts[i, ids[i] * 8 + ids[i + 1]] += 1  # pairs of consecutive tokens
        tables.append(counts)
    for i in range(3):
        table = torch.stack([tables[0][i], tables[1][i]])  # (2, 64)
        table = table[:, table.sum(0) > 0]
        assert chi2_contingency(table.numpy()).pvalue > 1e-3


def test_partly_wrong_drafts_give_the_plain_answer(model):
    prompt = repeating_prompt(9)
    outputs = []
    for speculation in (None, Scripted(ScriptedDrafter(len(prompt), [], 0.0))):
        engine = Engine(model, kv_memory_bytes=1 << 20, block_size=4, prefill_chunk=512)
        seq = engine.start(prompt)
        if speculation is not None:
            speculation.drafter.answer = outputs[0]
            speculation.drafter.wrong_share = 0.3
        params = SamplingParams(max_tokens=40)
        steps = list(
            generate(engine, seq, params, frozenset(), StreamDetokenizer(CharTokenizer()), speculation)
        )
        outputs.append([s.token_id for s in steps])
        assert seq.num_computed == seq.num_tokens - 1
    assert outputs[1] == outputs[0]
