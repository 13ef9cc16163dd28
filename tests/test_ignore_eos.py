"""`sampling.ignore_eos`: an answer runs exactly max_tokens tokens, with or without speculation, and is
the answer a full recompute gives when the end tokens can never be picked."""

from __future__ import annotations

import pytest
import torch

from kvchat.config import Settings, load_settings, replace_setting
from kvchat.engine.sampling import SamplingParams, make_sampler
from tests.support.speculation import (
    EveryMatch,
    Scripted,
    ScriptedDrafter,
    repeating_prompt,
    run,
    varied_model,
)


@pytest.fixture(scope="module")
def model():
    return varied_model()


def naive_greedy(model, prompt: list[int], num_tokens: int, banned: set[int]) -> list[int]:
    """The full recompute: the whole sequence through the model for every token, banned ids masked."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()  # (V,)
            logits[list(banned)] = -torch.inf
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def an_end(model, prompt: list[int]) -> tuple[list[int], int]:
    """The greedy answer and a place in it whose token, taken as the end token, would stop it there."""
    answer = [s.token_id for s in run(model, prompt, params=SamplingParams(max_tokens=40))[0]]
    cut = next(i for i in range(3, 40) if answer[i] not in answer[:i])
    return answer, cut


def test_an_end_token_stops_the_answer_unless_ignored(model):
    prompt = repeating_prompt(5)
    answer, cut = an_end(model, prompt)
    eos = frozenset({answer[cut]})
    stopped = run(model, prompt, params=SamplingParams(max_tokens=40), eos=eos)[0]
    assert len(stopped) == cut + 1 and stopped[-1].finish_reason == "stop"

    params = SamplingParams(max_tokens=40, ignore_eos=True)
    steps = run(model, prompt, params=params, eos=eos)[0]
    assert len(steps) == 40 and steps[-1].finish_reason == "length"
    assert [s.finish_reason for s in steps[:-1]] == [None] * 39
    token_ids = [s.token_id for s in steps]
    assert answer[cut] not in token_ids
    assert token_ids == naive_greedy(model, prompt, 40, {answer[cut]})


def test_drafted_end_tokens_are_never_accepted(model):
    # The drafter proposes the answer that the end token would cut; those drafts must be refused.
    prompt = repeating_prompt(5)
    answer, cut = an_end(model, prompt)
    eos = frozenset({answer[cut]})
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = run(model, prompt, params=params, eos=eos)
    drafter = Scripted(ScriptedDrafter(len(prompt), answer, 0.0), draft_max=8)
    spec = run(model, prompt, drafter, params=params, eos=eos)
    assert [s.token_id for s in spec[0]] == [s.token_id for s in plain[0]]
    assert spec[1:] == plain[1:]  # the same sequence and block state afterwards
    looked_up = run(model, repeating_prompt(5), EveryMatch(), params=params, eos=eos)[0]
    assert [s.token_id for s in looked_up] == [s.token_id for s in plain[0]]


def test_sampled_answers_run_to_max_tokens_and_stop_strings_do_not_end_them(model):
    prompt = repeating_prompt(6)
    answer, cut = an_end(model, prompt)
    stop = (f"<{answer[cut]}>",)  # CharTokenizer's text of that token
    params = SamplingParams(temperature=1.0, max_tokens=30, seed=3, stop=stop, ignore_eos=True)
    for speculation in (None, EveryMatch()):
        steps = run(model, prompt, speculation, params, eos=frozenset(answer[:cut]))[0]
        assert len(steps) == 30 and steps[-1].finish_reason == "length"
        assert not set(answer[:cut]) & {s.token_id for s in steps}


def test_the_sampler_never_draws_nor_accepts_a_banned_token():
    logits = torch.tensor([5.0, 4.0, -1.0, 0.0])  # token 0 dominates
    greedy = make_sampler(SamplingParams(), banned_ids=frozenset({0}))
    assert greedy.sample(logits) == 1 and greedy.verify(logits, None, 0) == 1
    sampled = make_sampler(SamplingParams(temperature=1.0, seed=0), banned_ids=frozenset({0, 1}))
    drawn = {sampled.sample(logits) for _ in range(200)}
    accepted = {sampled.verify(logits, None, 0) for _ in range(200)}
    assert drawn == accepted == {2, 3}


def test_the_setting_and_its_flag():
    assert Settings().sampling.ignore_eos is False
    assert replace_setting(Settings(), "ignore_eos", "on").sampling.ignore_eos is True
    assert load_settings(None, flags={"--ignore-eos": True}).sampling.ignore_eos is True
