"""Speculative decoding's drafting stage: guesses of the next tokens, which the token loop verifies.

A drafter proposes tokens after a sequence's tokens; `generate` checks them all in one forward and keeps
the ones the sampler accepts. Pure Python over ints, except the draft model (which runs its own Engine).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvchat.errors import DraftModelError

if TYPE_CHECKING:
    from kvchat.engine.engine import Engine


class Drafter(Protocol):
    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` guesses of the tokens that follow `token_ids` (which only grows between
        calls of one generation)."""
        ...

    def close(self) -> None:
        """Release what the drafter holds (called once, when its generation ends)."""
        ...


@dataclass(frozen=True)
class Speculation:
    """How an inference drafts: `mode` off, prompt-lookup or draft, at most `draft_max` tokens per step;
    mode "draft" drafts with `draft_engine`'s model, which shares the main model's tokenizer."""

    mode: str
    draft_max: int
    draft_engine: Engine | None = None

    def __post_init__(self) -> None:
        if self.mode == "draft" and self.draft_engine is None:
            raise DraftModelError(
                "speculate = draft needs a draft model: set model.draft_model (--draft-model)"
            )

    def make_drafter(self, vocab_size: int, cost: Callable[[int], float] | None = None) -> Drafter | None:
        """A drafter for one generation by a model with `vocab_size` token ids, on an engine whose
        verification of k drafts costs `cost(k)` single-token steps (see DraftBudget)."""
        if self.mode == "off" or self.draft_max < 1:
            return None
        if self.mode == "prompt-lookup":
            return PromptLookup(min_ngram=paying_ngram(cost) if cost else 1)
        assert self.mode == "draft" and self.draft_engine is not None, "mode draft needs a draft engine"
        from kvchat.engine.draft_model import DraftModel  # torch only where a draft model runs

        return DraftModel(self.draft_engine, vocab_size)


# What an inference given no speculation does: decode one token at a time.
NO_SPECULATION = Speculation("off", 1)


# Drafts accepted per step after a match of 1, 2 and 3 tokens: 0.28, 0.64-0.77 and 1.44-3.48 over the
# prompts of scripts/bench_speculative.py (SmolLM2-135M, greedy), the lower figure of each.
ACCEPTED_AFTER_MATCH = {1: 0.28, 2: 0.64, 3: 1.44}


def paying_ngram(cost: Callable[[int], float], max_ngram: int = 3) -> int:
    """The shortest match whose drafts pay for their verification on average (4 drafts), else the
    longest: a one-token match pays where checking drafts is nearly free (bf16 on oneDNN's kernel), not
    where 4 drafts cost 1.8 tokens or more (bf16 on kvchat's kernel, fp32, int8, int4)."""
    for n in range(1, max_ngram + 1):
        if 1 + ACCEPTED_AFTER_MATCH.get(n, 0.0) >= cost(4):
            return n
    return max_ngram


class PromptLookup:
    """Drafts by copying: finds the latest earlier occurrence of the last n tokens (n from `max_ngram`
    down to `min_ngram`) and proposes what followed it. Matches the whole sequence: system, passages,
    outputs reused as context, and the answer so far."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min(min_ngram, max_ngram)
        self.follower: dict[tuple[int, ...], int] = {}  # n-gram -> where what followed its latest copy starts
        self.num_indexed = 0  # n-grams ending before this position are indexed

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        self._index(token_ids)
        for n in range(min(self.max_ngram, len(token_ids) - 1), self.min_ngram - 1, -1):
            start = self.follower.get(tuple(token_ids[-n:]))
            if start is not None:
                return token_ids[start : start + max_tokens]
        return []

    def _index(self, token_ids: list[int]) -> None:
        # An n-gram ending at `end` is indexed once the token after it exists; later copies win.
        assert len(token_ids) >= self.num_indexed
        for end in range(self.num_indexed, len(token_ids) - 1):
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self.follower[tuple(token_ids[end - n + 1 : end + 1])] = end + 1
        self.num_indexed = max(self.num_indexed, len(token_ids) - 1)

    def close(self) -> None:
        pass


class DraftBudget:
    """How many tokens to draft next, from what drafting has made so far and what verifying costs.

    `cost(k)` is what a forward over the last token and k drafts costs, in single-token steps of the
    engine's decode path (`Engine.verify_cost`). A step that drafted k tokens is worth the tokens it made
    (the accepted drafts and the token after them) over cost(k). Drafting pauses (for longer each time)
    while the moving average of that worth is under 1, so free writing runs at the plain speed. The
    average starts optimistic, so a few misses at the start do not stop drafting; after a pause one step
    decides whether to go on. The size grows on full acceptance and halves on a rejection (never below
    just past the accepted run). Every decision follows from the tokens alone, never from a clock, so a
    seeded answer is the same on every run."""

    def __init__(self, max_tokens: int, cost: Callable[[int], float], decay: float = 0.7):
        self.max_tokens, self.cost, self.decay = max_tokens, cost, decay
        self.size = min(4, max_tokens)
        self.worth = 2.0  # moving average of drafting's worth, in plain steps' tokens per step's cost
        self.paused = 0  # steps left without drafting
        self.pause_length = 4
        self.num_drafted = 0
        self.num_accepted = 0

    def next_size(self) -> int:
        if self.paused > 0:
            self.paused -= 1
            return 0
        return self.size

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        if num_accepted == num_drafted:
            self.size = min(self.max_tokens, self.size + 2)
            self.pause_length = 4
        else:
            self.size = max(1, num_accepted + 1, self.size // 2)
        worth = (num_accepted + 1) / self.cost(num_drafted)
        self.worth = self.decay * self.worth + (1 - self.decay) * worth
        if self.worth < 1.0:
            self.paused, self.pause_length = self.pause_length, min(64, 2 * self.pause_length)
            self.worth = 1.0  # after the pause, one step decides whether to go on
