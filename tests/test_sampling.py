import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvchat.engine.sampling import (
    SamplingParams,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    make_sampler,
)

INF = math.inf


def hf(processor, logits: torch.Tensor, seen_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Run a transformers processor on a batch of one."""
    ids = torch.zeros((1, 0), dtype=torch.long) if seen_ids is None else seen_ids[None]
    return processor(ids, logits[None].clone())[0]


def random_logits(seed: int, size: int) -> torch.Tensor:
    """Plain, tie-heavy and extreme logits, by seed."""
    g = torch.Generator().manual_seed(seed)
    kind = seed % 4
    if kind == 0:
        return torch.randn(size, generator=g) * 4  # (V,)
    if kind == 1:
        return torch.randint(-3, 3, (size,), generator=g).float()  # (V,) many ties
    if kind == 2:
        x = torch.randn(size, generator=g) * 1e4  # (V,) softmax saturates to exact 0 and 1
        x[torch.randint(0, size, (size // 5,), generator=g)] = -INF
        return x
    x = torch.randn(size, generator=g) * 0.01  # (V,) nearly flat
    x[torch.randint(0, size, (3,), generator=g)] = 30.0
    return x


def assert_same_up_to_ties(ours: torch.Tensor, theirs: torch.Tensor, logits: torch.Tensor) -> None:
    """Equal, except that which of several exactly tied logits gets cut may differ (transformers' sort is
    unstable there): the same values survive, and only tied positions differ."""
    if torch.equal(ours, theirs):
        return
    assert torch.equal(ours.sort().values, theirs.sort().values)
    for i in (ours != theirs).nonzero().squeeze(1).tolist():
        assert (logits == logits[i]).sum() > 1, f"untied token {i} differs"


# Hand-built cases with exact expectations.


def test_repetition_penalty_by_hand():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.0, -1.0])
    seen = torch.tensor([0, 1, 1, 1, 3, 0])
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert torch.equal(out, torch.tensor([1.0, -4.0, 1.0, 0.0, -1.0]))
    assert torch.equal(logits, torch.tensor([2.0, -2.0, 1.0, 0.0, -1.0]))  # input untouched


def test_repetition_penalty_ignores_ids_outside_vocab():
    out = apply_repetition_penalty(torch.tensor([4.0, 4.0]), torch.tensor([1, 7]), 2.0)
    assert torch.equal(out, torch.tensor([4.0, 2.0]))


def test_temperature_by_hand():
    assert torch.equal(apply_temperature(torch.tensor([1.0, -2.0, 0.5]), 0.5), torch.tensor([2.0, -4.0, 1.0]))


def test_top_k_by_hand():
    logits = torch.tensor([1.0, 5.0, 3.0, 3.0, -1.0])
    assert torch.equal(apply_top_k(logits, 2), torch.tensor([-INF, 5.0, 3.0, 3.0, -INF]))  # tie kept
    assert torch.equal(apply_top_k(logits, 1), torch.tensor([-INF, 5.0, -INF, -INF, -INF]))
    assert torch.equal(apply_top_k(logits, 99), logits)
    assert apply_top_k(logits, 0) is logits


def test_top_p_by_hand():
    logits = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    # Sorted up: 0.125, 0.125, 0.25, 0.5 -> cumulative 0.125, 0.25, 0.5, 1.0; cut where <= 1 - top_p.
    assert torch.equal(apply_top_p(logits, 0.5), torch.tensor([math.log(0.5), -INF, -INF, -INF]))
    assert torch.equal(apply_top_p(logits, 0.6), logits.masked_fill(torch.tensor([0, 0, 1, 1]).bool(), -INF))
    assert torch.equal(apply_top_p(logits, 0.9), logits)
    assert torch.equal(apply_top_p(logits, 1e-9), torch.tensor([math.log(0.5), -INF, -INF, -INF]))
    assert apply_top_p(logits, 1.0) is logits


def test_top_p_keeps_at_least_one():
    logits = torch.tensor([0.0, 0.0, 0.0, 0.0])
    assert (apply_top_p(logits, 0.01) > -INF).sum() == 1


def test_min_p_by_hand():
    logits = torch.tensor([0.5, 0.25, 0.15, 0.1]).log()
    # Threshold 0.4 * 0.5 = 0.2 of the top probability.
    assert torch.equal(apply_min_p(logits, 0.4), logits.masked_fill(torch.tensor([0, 0, 1, 1]).bool(), -INF))
    assert apply_min_p(logits, 0.0) is logits


# The same as transformers' processors.


@pytest.mark.parametrize("seed", range(40))
def test_steps_equal_transformers(seed):
    logits = random_logits(seed, 1000 if seed % 2 else 50)
    g = torch.Generator().manual_seed(seed)
    seen = torch.randint(0, logits.numel(), (300,), generator=g)  # (T,) with repeats
    penalty = [0.5, 1.3, 2.0][seed % 3]
    top_k = [1, 2, 7, 49, 5000][seed % 5]
    top_p = [0.01, 0.3, 0.8, 0.95, 0.999][seed % 5]
    min_p = [0.001, 0.05, 0.5, 0.99][seed % 4]
    assert torch.equal(
        apply_repetition_penalty(logits, seen, penalty),
        hf(RepetitionPenaltyLogitsProcessor(penalty), logits, seen),
    )
    assert torch.equal(apply_temperature(logits, 0.7), hf(TemperatureLogitsWarper(0.7), logits))
    assert torch.equal(apply_top_k(logits, top_k), hf(TopKLogitsWarper(top_k), logits))
    assert torch.equal(apply_min_p(logits, min_p), hf(MinPLogitsWarper(min_p), logits))
    assert_same_up_to_ties(apply_top_p(logits, top_p), hf(TopPLogitsWarper(top_p), logits), logits)


@pytest.mark.parametrize("seed", range(10))
def test_top_p_after_top_k_equals_transformers(seed):
    logits = apply_top_k(random_logits(seed, 2000), 20)
    assert_same_up_to_ties(apply_top_p(logits, 0.9), hf(TopPLogitsWarper(0.9), logits), logits)


def test_top_p_without_ties_is_exact_on_a_full_vocabulary():
    logits = torch.randn(151936, generator=torch.Generator().manual_seed(0)) * 3
    for top_p in (0.5, 0.9, 0.99):
        assert torch.equal(apply_top_p(logits, top_p), hf(TopPLogitsWarper(top_p), logits))


# The sampler.


def test_greedy_is_argmax_after_penalty():
    logits = torch.tensor([1.0, 3.0, 2.9, -1.0])
    sampler = make_sampler(SamplingParams(temperature=0.0, top_k=1, top_p=0.1))
    assert sampler.sample(logits) == 1
    assert sampler.sample(logits.to(torch.bfloat16)) == 1
    penalized = make_sampler(SamplingParams(repetition_penalty=1.5))
    assert penalized.sample(logits, torch.tensor([1, 1])) == 2
    assert penalized.sample(logits, torch.tensor([], dtype=torch.long)) == 1


def test_same_seed_same_stream_and_other_seeds_differ():
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=42)

    def stream(p: SamplingParams) -> list[int]:
        sampler = make_sampler(p)
        return [sampler.sample(logits) for _ in range(200)]

    first = stream(params)
    assert first == stream(params)
    assert first != stream(SamplingParams(temperature=1.0, seed=43))
    assert len(set(first)) > 50  # a stream, not one token repeated


def test_unseeded_samplers_differ():
    logits = torch.zeros(100_000)
    a, b = make_sampler(SamplingParams(temperature=1.0)), make_sampler(SamplingParams(temperature=1.0))
    assert [a.sample(logits) for _ in range(5)] != [b.sample(logits) for _ in range(5)]


def test_top_k_2_only_yields_the_top_two():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9, 1.8, 0.0])
    sampler = make_sampler(SamplingParams(temperature=1.0, top_k=2, seed=0))
    counts = torch.bincount(torch.tensor([sampler.sample(logits) for _ in range(2000)]), minlength=6)
    assert set(counts.nonzero().squeeze(1).tolist()) == {1, 3}
    # exp(2.0) / (exp(2.0) + exp(1.9)) = 0.525
    assert abs(counts[1].item() / 2000 - 0.525) < 0.05


@pytest.mark.slow  # statistical: many draws
def test_empirical_distribution_matches_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, -INF])
    sampler = make_sampler(SamplingParams(temperature=1.0, seed=3))
    counts = torch.bincount(torch.tensor([sampler.sample(logits) for _ in range(20_000)]), minlength=5)
    assert counts[4] == 0
    assert torch.allclose(counts / 20_000, logits.softmax(-1), atol=0.015)


def test_low_temperature_acts_like_greedy():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    sampler = make_sampler(SamplingParams(temperature=1e-4, seed=0))
    assert {sampler.sample(logits) for _ in range(50)} == {int(logits.argmax())}


def test_filters_compose_in_transformers_order():
    logits = torch.randn(3000, generator=torch.Generator().manual_seed(9)) * 2
    seen = torch.randint(0, 3000, (100,), generator=torch.Generator().manual_seed(10))
    x = hf(RepetitionPenaltyLogitsProcessor(1.2), logits, seen)
    for processor in (
        TemperatureLogitsWarper(0.8),
        TopKLogitsWarper(50),
        TopPLogitsWarper(0.7),
        MinPLogitsWarper(0.1),
    ):
        x = hf(processor, x)
    allowed = set((x > -INF).nonzero().squeeze(1).tolist())
    sampler = make_sampler(
        SamplingParams(temperature=0.8, top_k=50, top_p=0.7, min_p=0.1, repetition_penalty=1.2)
    )
    drawn = {sampler.sample(logits, seen) for _ in range(500)}
    assert drawn <= allowed
    assert len(drawn) > 1


def test_sampling_does_not_modify_logits():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    params = SamplingParams(temperature=0.5, top_k=10, top_p=0.9, min_p=0.01, repetition_penalty=1.3)
    make_sampler(params).sample(logits, torch.arange(20))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9), SamplingParams(temperature=1, top_k=40)])
def test_no_vocabulary_sort_without_top_p(monkeypatch, params):
    # Sorting 152k logits costs more than a small model's whole decode step on this CPU.
    def no_sort(*args, **kwargs):
        raise AssertionError("sorted the vocabulary")

    monkeypatch.setattr(torch, "sort", no_sort)
    monkeypatch.setattr(torch, "argsort", no_sort)
    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    monkeypatch.setattr(torch.Tensor, "argsort", no_sort)
    make_sampler(params).sample(torch.randn(151936))


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324, 1e-7, 1e300])
@pytest.mark.parametrize("penalty", [1.0, 1e-300, 1e300])
def test_extreme_values_give_a_token_in_the_vocabulary(temperature, penalty):
    logits = torch.randn(1000) * 10  # (V,)
    seen = torch.arange(0, 1000, 3)  # (T,)
    params = SamplingParams(
        temperature=temperature, repetition_penalty=penalty, top_p=0.9, min_p=0.05, seed=0
    )
    sampler = make_sampler(params)
    for _ in range(20):
        assert 0 <= sampler.sample(logits, seen) < logits.numel()


def test_tiny_temperature_is_greedy():
    logits = torch.randn(49152)  # (V,)
    sampler = make_sampler(SamplingParams(temperature=1e-40, seed=1))
    assert {sampler.sample(logits) for _ in range(10)} == {int(logits.argmax())}


@pytest.mark.parametrize(
    "bad", [{"temperature": math.inf}, {"temperature": math.nan}, {"repetition_penalty": math.inf}]
)
def test_make_sampler_rejects_non_finite(bad):
    with pytest.raises(ValueError, match="finite"):
        make_sampler(SamplingParams(**bad))


# Written out by hand from what each parameter means, not from either implementation's checks.
SAMPLING_CASES = [
    ("temperature", 0.0, True),
    ("temperature", 1e-40, True),
    ("temperature", 2.0, True),
    ("temperature", -0.1, False),
    ("temperature", INF, False),
    ("temperature", math.nan, False),
    ("top_k", 0, True),
    ("top_k", 50, True),
    ("top_k", -1, False),
    ("top_p", 1.0, True),
    ("top_p", 1e-9, True),
    ("top_p", 0.0, False),
    ("top_p", 1.01, False),
    ("top_p", math.nan, False),
    ("min_p", 0.0, True),
    ("min_p", 0.999, True),
    ("min_p", 1.0, False),
    ("min_p", -0.1, False),
    ("repetition_penalty", 1.0, True),
    ("repetition_penalty", 1e-300, True),
    ("repetition_penalty", 0.0, False),
    ("repetition_penalty", -1.0, False),
    ("repetition_penalty", INF, False),
    ("max_tokens", 1, True),
    ("max_tokens", 0, False),
    ("seed", 0, True),
    ("seed", 2**64 - 1, True),
    ("seed", -1, False),
    ("seed", 2**64, False),
]


@pytest.mark.parametrize(("name", "value", "valid"), SAMPLING_CASES)
def test_the_sampler_accepts_exactly_the_valid_values(name, value, valid):
    params = SamplingParams(**{name: value})
    if valid:
        make_sampler(params)
    else:
        with pytest.raises(ValueError):
            make_sampler(params)


@pytest.mark.parametrize(("name", "value", "valid"), SAMPLING_CASES)
def test_set_accepts_exactly_the_valid_values(name, value, valid):
    from kvchat.config import Settings, replace_setting
    from kvchat.errors import ConfigError

    if valid:
        assert getattr(replace_setting(Settings(), name, repr(value)).sampling, name) == value
    else:
        with pytest.raises(ConfigError):
            replace_setting(Settings(), name, repr(value))
