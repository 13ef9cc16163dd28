"""The token loop: prefill, then decode one token at a time, streamed as small records."""

from __future__ import annotations

import time
from collections.abc import Generator

import torch

from kvchat.engine.block_manager import Sequence
from kvchat.engine.detokenizer import StreamDetokenizer
from kvchat.engine.engine import Engine
from kvchat.engine.records import GenerationStats, GenerationStep, PrefillProgress
from kvchat.engine.sampling import Sampler, SamplingParams, make_sampler
from kvchat.engine.speculate import DraftBudget, Speculation


class StopStrings:
    """Holds back text that could be the start of a stop string, and reports when one appears."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(s for s in stop if s)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found)."""
        if not self.stop:
            return text, False
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        cut = max(0, len(self.pending) - self.holdback)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def generate(
    engine: Engine,
    seq: Sequence,
    params: SamplingParams,
    eos_token_ids: frozenset[int],
    detokenizer: StreamDetokenizer,
    speculation: Speculation | None = None,
) -> Generator[PrefillProgress | GenerationStep, None, None]:
    """Sample up to `params.max_tokens` tokens after the sequence's tokens, appending them to it.

    The last sampled token is appended without its KV (nothing reads it unless the caller computes
    it). Closing the generator stops it within one token; the sequence stays consistent. With
    `speculation`, each forward also checks drafted tokens and may yield several tokens at once. With
    `params.ignore_eos` the answer runs to `max_tokens`: the sampler never picks an end token (nor
    accepts one drafted), and stop strings do not end it.
    """
    sampler = make_sampler(params, engine.device, eos_token_ids if params.ignore_eos else frozenset())
    ends = _Ends(params, eos_token_ids, detokenizer)
    prompt_tokens, reused = seq.num_tokens, seq.num_computed
    seen = _Seen(seq.token_ids, engine.device) if params.repetition_penalty != 1.0 else None
    vocab_size = engine.model.config.vocab_size

    def cost(num_drafts: int) -> float:  # at the sequence's length when asked
        return engine.verify_cost(num_drafts, seq.num_tokens)

    drafter = speculation.make_drafter(vocab_size, cost) if speculation else None
    budget = DraftBudget(speculation.draft_max, cost) if speculation and drafter else None
    t0 = time.perf_counter()
    num_kept = prompt_tokens  # the sequence up to the last token yielded
    try:
        while seq.num_tokens - seq.num_computed > engine.prefill_chunk:
            engine.compute(seq, until=seq.num_computed + engine.prefill_chunk)
            yield PrefillProgress(seq.num_computed - reused, prompt_tokens - reused)
        logits = engine.compute(seq)  # (V,)
        t_prefill = time.perf_counter() - t0
        run = [sampler.sample(logits, seen.ids if seen else None)]
        engine.extend(seq, run)
        ttft = time.perf_counter() - t0
        t_step, decode_s, n = t0 + ttft, 0.0, 0
        while True:
            for i, token in enumerate(run):
                n += 1
                text, thinking, finish = ends.add(token, n)
                num_kept = seq.num_tokens - (len(run) - 1 - i)
                if finish is not None:
                    _keep(engine, seq, num_kept)  # an accepted run may go on past the end
                decode_s += time.perf_counter() - t_step  # the consumer's time between steps is not counted
                stats = GenerationStats(
                    *(prompt_tokens, reused, prompt_tokens - reused, n, ttft, t_prefill, decode_s),
                    *((budget.num_drafted, budget.num_accepted) if budget else (0, 0)),
                )
                yield GenerationStep(token, text, thinking, finish, stats)
                t_step = time.perf_counter()
                if finish is not None:
                    return
            if seen is not None:
                seen.add(run)
            # Room for the drafts and the token sampled after them; no more than max_tokens.
            if drafter is None or budget is None:
                run = _advance(engine, seq, sampler, seen, [])
                continue
            size = min(budget.next_size(), params.max_tokens - n - 1, _room(engine, seq) - 1)
            drafts = drafter.propose(seq.token_ids, size) if size > 0 else []
            run = _advance(engine, seq, sampler, seen, drafts)
            budget.update(len(drafts), len(run) - 1 if drafts else 0)
    except BaseException:  # Ctrl-C, an error, the stream closed: back to what was yielded, no more
        if num_kept > prompt_tokens:
            _keep(engine, seq, num_kept)
        raise
    finally:
        if drafter:
            drafter.close()


class _Ends:
    """Turns each sampled token into final text and says whether it ends the answer, and why."""

    def __init__(self, params: SamplingParams, eos_token_ids: frozenset[int], detokenizer: StreamDetokenizer):
        self.max_tokens, self.eos_token_ids, self.detokenizer = params.max_tokens, eos_token_ids, detokenizer
        self.stops = StopStrings(() if params.ignore_eos else params.stop)

    def add(self, token: int, num_generated: int) -> tuple[str, str, str | None]:
        """(answer text, thinking text, finish reason or None) of the `num_generated`-th token."""
        finish = "stop" if token in self.eos_token_ids else None
        text, thinking = self.detokenizer.add(token)
        text, hit = self.stops.feed(text)
        if hit:
            finish = "stop_string"
        elif finish is None and num_generated == self.max_tokens:
            finish = "length"
        if finish is not None:
            tail_text, tail_thinking = self.detokenizer.finish()
            if finish != "stop_string":
                text += self.stops.feed(tail_text)[0] + self.stops.flush()
            thinking += tail_thinking
        return text, thinking, finish


class _Seen:
    """The ids the repetition penalty sees: the sequence so far."""

    def __init__(self, token_ids: list[int], device: torch.device):
        self.device = device
        self.ids = torch.tensor(token_ids, device=device)  # (T,)

    def add(self, token_ids: list[int]) -> None:
        self.ids = torch.cat([self.ids, torch.tensor(token_ids, device=self.device)])  # (T + n,)

    def with_drafts(self, drafts: list[int], num: int) -> torch.Tensor:
        return torch.cat([self.ids, torch.tensor(drafts[:num], device=self.device, dtype=torch.long)])


def _advance(
    engine: Engine, seq: Sequence, sampler: Sampler, seen: _Seen | None, drafts: list[int]
) -> list[int]:
    """Compute the last token's KV together with `drafts` appended after it, in one forward; keep the
    drafts the sampler accepts and append one token sampled after them. Returns the tokens appended."""
    if not drafts:
        token = sampler.sample(engine.compute(seq), seen.ids if seen else None)
        engine.extend(seq, [token])
        return [token]
    start = seq.num_tokens  # the drafts' first position
    engine.extend(seq, drafts)
    logits = engine.compute(seq, all_logits=True, record=False)  # (1 + k, V)
    tokens: list[int] = []
    for i, draft in enumerate(drafts):
        tokens.append(sampler.verify(logits[i], seen.with_drafts(drafts, i) if seen else None, draft))
        if tokens[-1] != draft:
            break
    else:
        tokens.append(sampler.sample(logits[-1], seen.with_drafts(drafts, len(drafts)) if seen else None))
    engine.truncate(seq, start + len(tokens) - 1)  # the rejected drafts' KV goes
    engine.extend(seq, tokens[-1:])
    return tokens


def _keep(engine: Engine, seq: Sequence, num_tokens: int) -> None:
    """Cut the sequence to its first `num_tokens` tokens, the last of them without KV, as the plain
    loop leaves it after sampling."""
    if num_tokens < seq.num_tokens or seq.num_computed >= num_tokens:
        last = seq.token_ids[num_tokens - 1]
        engine.truncate(seq, num_tokens - 1)
        engine.extend(seq, [last])


def _room(engine: Engine, seq: Sequence) -> int:
    """How many tokens the sequence can grow by without evicting cached KV to hold them."""
    bs = engine.block_size
    held = len(seq.block_table) * bs - seq.num_tokens
    return held + bs * engine.blocks.num_free_empty(engine.prefill_chunk // bs + 1)
