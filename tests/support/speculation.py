"""Speculative decoding's test pieces: scripted and prompt-lookup drafters, tiny models whose greedy
answers vary, and a run of the token loop that returns its steps and the block manager's state."""

from __future__ import annotations

import random

import torch

from kvchat.engine.detokenizer import StreamDetokenizer
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.speculate import PromptLookup
from tests.support.tiny_models import make_tiny_model


class CharTokenizer:
    """Each id decodes to its own short text, so stop strings can name tokens."""

    def decode(self, token_ids: list[int]) -> str:
        return "".join(f"<{t}>" for t in token_ids)


class ScriptedDrafter:
    """Proposes a known answer's continuation, with wrong tokens mixed in at random."""

    def __init__(self, prompt_len: int, answer: list[int], wrong_share: float, seed: int = 0):
        self.prompt_len, self.answer, self.wrong_share = prompt_len, answer, wrong_share
        self.rng = random.Random(seed)

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        done = len(token_ids) - self.prompt_len
        guess = self.answer[done : done + max_tokens]
        return [t ^ 1 if self.rng.random() < self.wrong_share else t for t in guess]  # ids stay in range

    def close(self) -> None:
        pass


class Scripted:
    """A stand-in for Speculation that hands out a given drafter."""

    def __init__(self, drafter, draft_max: int = 6):
        self.drafter, self.draft_max = drafter, draft_max

    def make_drafter(self, vocab_size, cost=None):
        return self.drafter


class EveryMatch:
    """Prompt lookup that drafts after a match of any length, whatever verifying costs: on a tiny fp32
    model kvchat drafts only after three-token matches, which its answers seldom repeat."""

    draft_max = 6

    def make_drafter(self, vocab_size, cost=None):
        return PromptLookup()


def varied_model(kind: str = "llama", seed: int = 0):
    """A tiny random model whose greedy answers vary: at init scale they repeat one token."""
    model = make_tiny_model(kind, vocab_size=64, seed=seed)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() > 1:
                weight.mul_(10.0)
    return model


def repeating_prompt(seed: int = 0, vocab: int = 64) -> list[int]:
    rng = random.Random(seed)
    passage = [rng.randrange(vocab) for _ in range(40)]
    return passage + [rng.randrange(vocab) for _ in range(5)] + passage[:12]


def block_state(engine: Engine) -> tuple:
    b = engine.blocks
    blocks = [(x.ref_count, x.pin_count, x.parent_hash, tuple(x.token_ids), x.hash) for x in b.blocks]
    return blocks, dict(b._by_hash), {k: set(v) for k, v in b._children.items()}, list(b._unreferenced)


def run(model, prompt, speculation=None, params=None, eos=frozenset(), kv_memory=1 << 20, filler=None):
    params = params or SamplingParams(max_tokens=60)
    engine = Engine(model, kv_memory_bytes=kv_memory, block_size=4, prefill_chunk=512)
    if filler:  # leave every free block holding cached KV, so that taking one evicts it
        held = engine.start(filler)
        engine.compute(held)
        engine.free(held)
    seq = engine.start(prompt)
    steps = list(generate(engine, seq, params, eos, StreamDetokenizer(CharTokenizer()), speculation))
    engine.blocks.check_invariants()
    state = (seq.token_ids, seq.num_computed, seq.num_recorded, seq.block_table, block_state(engine))
    engine.free(seq)
    return steps, state, block_state(engine)
