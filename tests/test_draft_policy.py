"""What to draft: prompt lookup's matches and the draft budget, pure Python over ints (the token loop
that verifies the drafts is tested in test_speculative.py)."""

from __future__ import annotations

from collections.abc import Callable

from kvchat.engine.speculate import DraftBudget, PromptLookup, Speculation, paying_ngram


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    lookup = PromptLookup(max_ngram=3)
    assert lookup.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 2) == [7, 5]  # the later copy of 2 3
    assert lookup.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3, 9, 2, 3], 3) == [9, 2, 3]  # grown: re-indexed
    assert PromptLookup().propose([5, 2, 3, 8, 1, 2, 3, 7, 5, 2, 3], 2) == [8, 1]  # 5 2 3 beats a later 2 3
    assert PromptLookup().propose([4, 5, 6], 4) == []
    assert PromptLookup().propose([4, 5, 4], 4) == [5, 4]  # a copy may run into the end


def test_prompt_lookup_drafts_only_after_a_match_as_long_as_it_is_told():
    tokens = [1, 2, 3, 9, 7, 2, 3, 8, 4, 3]  # 3 last followed by 8; 2 3 by 8; nothing ends with 4 3
    assert PromptLookup(min_ngram=1).propose(tokens, 2) == [8, 4]
    assert PromptLookup(min_ngram=2).propose(tokens, 2) == []
    assert PromptLookup(min_ngram=2).propose([*tokens[:-2], 2, 3], 2) == [8, 2]


def test_the_shortest_paying_match_follows_what_verifying_costs():
    assert paying_ngram(costing(1.0)) == 1  # bf16, lean step: one-token matches pay
    assert paying_ngram(costing(1.7)) == 3  # fp32: only a three-token match does
    assert paying_ngram(costing(2.8)) == 3  # none pays on average: the longest, and the budget decides
    assert Speculation("prompt-lookup", 8).make_drafter(64, costing(1.7)).min_ngram == 3


def costing(fixed: float) -> Callable[[int], float]:
    """A verification that costs `fixed` single-token steps, and 0.04 more a draft."""
    return lambda num_drafts: fixed + 0.04 * num_drafts


def test_budget_grows_and_shrinks():
    budget = DraftBudget(8, costing(1.0))
    assert budget.next_size() == 4
    budget.update(4, 4)
    assert budget.next_size() == 6
    budget.update(6, 0)
    assert budget.next_size() == 3
    budget.update(3, 2)
    assert budget.next_size() == 3
    assert (budget.num_drafted, budget.num_accepted) == (13, 6)


def sizes_asked(budget: DraftBudget, accepted: int, steps: int = 40) -> list[int]:
    """The sizes asked for over `steps` steps where each drafting step keeps `accepted` drafts."""
    sizes = []
    for _ in range(steps):
        sizes.append(budget.next_size())
        budget.update(sizes[-1], min(accepted, sizes[-1]))
    return sizes


def test_budget_weighs_what_a_step_makes_against_what_verifying_costs():
    # One draft held a step doubles a plain step's tokens: worth it where verifying costs 1.2 steps,
    # not where it costs 2.5 (a compiled single-token step against an eager forward over several).
    assert 0 not in sizes_asked(DraftBudget(8, costing(1.2)), accepted=1)
    dear = sizes_asked(DraftBudget(8, costing(2.5)), accepted=1)
    assert dear.count(0) >= 30
    pauses = [len(run) for run in "".join("x" if size == 0 else "." for size in dear).split(".") if run]
    assert pauses[:3] == [4, 8, 16]  # it tries again, after longer pauses each time


def test_budget_pauses_free_writing_sooner_where_misses_cost_more():
    def misses_before_pause(fixed: float) -> int:
        return sizes_asked(DraftBudget(8, costing(fixed)), accepted=0).index(0)

    assert misses_before_pause(1.05) > misses_before_pause(1.7) > misses_before_pause(2.5) >= 2
    assert sizes_asked(DraftBudget(8, costing(1.05)), accepted=0).count(0) >= 25
