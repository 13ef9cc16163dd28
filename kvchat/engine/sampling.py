"""The one sampler, built from SamplingParams (re-exported here for the engine's callers)."""

from __future__ import annotations

import math

import torch

from kvchat.engine.records import SamplingParams


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """Penalize every distinct token in `seen_ids` once: negative logits times `penalty`, others divided.

    Same as transformers' RepetitionPenaltyLogitsProcessor; ids outside the vocabulary are ignored.
    """
    ids = seen_ids[seen_ids < logits.numel()]  # (T,)
    picked = logits[ids]  # (T,)
    out = logits.clone()  # (V,)
    # Every duplicate of an id writes the same value, computed from the original logit: once per token.
    out[ids] = torch.where(picked < 0, picked * penalty, picked / penalty)
    # A tiny penalty can overflow a positive logit to inf, and inf - inf is nan further on.
    return out.clamp_(max=torch.finfo(out.dtype).max)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide the logits by `temperature` (> 0).

    A temperature outside the dtype's normal numbers would round to 0 or inf in the division (0 / 0 and
    inf / inf are nan), so it is brought within them.
    """
    info = torch.finfo(logits.dtype)
    return logits / min(max(temperature, info.tiny), info.max)  # (V,)


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the `top_k` largest logits (and any tied with the k-th); 0 is off and returns `logits` itself."""
    if top_k <= 0:
        return logits
    kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]  # ()
    return logits.masked_fill(logits < kth, -math.inf)  # (V,)


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens whose probabilities sum to `top_p` (at least one); 1.0 returns `logits`.

    Same rule as transformers' TopPLogitsWarper: a token is cut when the probability mass of it and all
    less likely tokens is <= 1 - top_p. Which of several exactly tied logits at the cut survives is arbitrary
    there too (it follows an unstable sort), and a cut within float rounding of 1 - top_p can fall one token
    apart (the masses are summed in another order).
    """
    if top_p >= 1.0:
        return logits
    probs = logits.softmax(-1)  # (V,)
    # Tokens this unlikely weigh at most (1 - top_p) / 2 all together, so they are cut whatever their order;
    # sorting only the rest keeps this off the full-vocabulary sort, slow at a vocabulary of 152k.
    is_head = probs > (1.0 - top_p) / (2 * probs.numel())  # (V,)
    head_ids = is_head.nonzero().squeeze(1)  # (H,)
    head_probs, order = torch.sort(probs[head_ids])  # (H,), (H,) ascending, like transformers
    tail_mass = probs.masked_fill(is_head, 0.0).sum()  # ()
    cumulative = tail_mass + head_probs.cumsum(0)  # (H,) mass of each token and all below it
    cut = cumulative <= 1.0 - top_p  # (H,)
    cut[-1] = False  # the most likely token always stays
    keep = torch.zeros_like(is_head)  # (V,)
    keep[head_ids[order[~cut]]] = True
    return logits.masked_fill(~keep, -math.inf)  # (V,)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Cut tokens less likely than `min_p` times the top token's probability; 0.0 returns `logits`.

    Same as transformers' MinPLogitsWarper; the top token always stays.
    """
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)  # (V,)
    return logits.masked_fill(probs < min_p * probs.max(), -math.inf)  # (V,)


class Sampler:
    """Chooses the next token from the last position's logits; build it with `make_sampler`."""

    def __init__(
        self, params: SamplingParams, generator: torch.Generator, banned_ids: frozenset[int] = frozenset()
    ) -> None:
        self.params = params
        self.generator = generator
        self.banned_ids = torch.tensor(sorted(banned_ids), dtype=torch.long, device=generator.device)  # (B,)

    def process(self, logits: torch.Tensor, seen_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The logits (V,) as the sampler draws from them: penalized, then (unless greedy) tempered and
        filtered; `seen_ids` (T,) are the prompt and output ids so far."""
        p = self.params
        x = logits.float()  # (V,) no copy when already fp32: every step below returns a new tensor
        if self.banned_ids.numel() > 0:  # never drawn, never accepted as a draft
            x = x.index_fill(0, self.banned_ids, -math.inf)  # (V,)
        if p.repetition_penalty != 1.0 and seen_ids is not None and seen_ids.numel() > 0:
            x = apply_repetition_penalty(x, seen_ids, p.repetition_penalty)
        if p.temperature == 0.0:
            return x
        if p.temperature != 1.0:
            # Largest logit at 0 first (softmax ignores the shift): a tiny temperature then sends the
            # others to -inf, greedy as the limit is, instead of inf - inf = nan further on.
            x = apply_temperature(x - x.max(), p.temperature)  # (V,)
        x = apply_top_k(x, p.top_k)
        x = apply_top_p(x, p.top_p)
        return apply_min_p(x, p.min_p)

    def sample(self, logits: torch.Tensor, seen_ids: torch.Tensor | None = None) -> int:
        """Pick a token id from `logits` (V,); `seen_ids` (T,) are the prompt and output ids so far."""
        x = self.process(logits, seen_ids)  # (V,)
        return int(x.argmax()) if self.params.temperature == 0.0 else self._draw(x)

    def verify(self, logits: torch.Tensor, seen_ids: torch.Tensor | None, draft_id: int) -> int:
        """`draft_id` if accepted, else the token to take instead; distributed exactly as `sample` draws
        when the draft was proposed deterministically (prompt lookup, a greedy draft model).

        Greedy accepts the argmax only. Sampling accepts the draft with its probability p(draft) and on
        rejection draws from p without the draft: p(draft) + (1 - p(draft)) * 0 for the draft, and
        (1 - p(draft)) * p(y) / (1 - p(draft)) = p(y) for any other y.
        """
        x = self.process(logits, seen_ids)  # (V,)
        if self.params.temperature == 0.0:
            return int(x.argmax())
        p_draft = x.softmax(-1)[draft_id]  # ()
        u = torch.rand((), generator=self.generator, device=x.device)  # ()
        rest = x.index_fill(0, torch.tensor([draft_id], device=x.device), -math.inf)  # (V,)
        if u < p_draft or bool(torch.isinf(rest).all()):
            return draft_id
        return self._draw(rest)

    def _draw(self, logits: torch.Tensor) -> int:
        # Inverse CDF instead of torch.multinomial: same distribution, a few times faster at 152k.
        # The running sum is fp64 so that tokens late in the vocabulary keep their tiny share of the mass.
        cdf = logits.softmax(-1).cumsum(0, dtype=torch.float64)  # (V,)
        total = cdf[-1:]  # (1,)
        u = torch.rand(1, generator=self.generator, device=cdf.device, dtype=torch.float64) * total  # (1,)
        token = torch.searchsorted(cdf, u, right=True)  # (1,)
        # u can round up to `total`; the first index that reaches it is the last token with mass.
        last = torch.searchsorted(cdf, total)  # (1,)
        return int(torch.minimum(token, last))


def make_sampler(
    params: SamplingParams, device: torch.device | str = "cpu", banned_ids: frozenset[int] = frozenset()
) -> Sampler:
    """Validate `params` (ValueError) and build the sampler, with its generator seeded once; it never
    picks a token of `banned_ids` (the end-of-turn tokens under `ignore_eos`)."""
    problem = params.problem()
    if problem is not None:
        raise ValueError(problem)
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return Sampler(params, generator, banned_ids)
