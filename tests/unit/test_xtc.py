"""XTC (exclude top choices) in mlxd's samplers (mlxd/engine/gpu/sampling.py): the tokens above
the threshold but the least likely of them are excluded, with the request's probability; the
end of the reply and a newline never are; a seeded request's coin comes from its own key."""

from __future__ import annotations

import math

import mlx.core as mx

from mlxd.engine.gpu.job import SamplingParams
from mlxd.engine.gpu.sampling import exclude_top_choices, make_sampling

PROBS = [0.5, 0.3, 0.15, 0.05]  # above 0.1: tokens 0, 1 and 2; the least likely of them is 2
LOGPROBS = mx.log(mx.array([PROBS]))


def kept(out: mx.array) -> list[int]:
    return [i for i, v in enumerate(out[0].tolist()) if not math.isinf(v)]


def test_the_top_choices_but_the_least_likely_of_them_are_excluded() -> None:
    key = mx.random.key(0)
    assert kept(exclude_top_choices(LOGPROBS, key, 1.0, 0.1, ())) == [2, 3]
    assert kept(exclude_top_choices(LOGPROBS, key, 1.0, 0.1, (0,))) == [0, 2, 3]  # an exempt token stays
    assert kept(exclude_top_choices(LOGPROBS, key, 1.0, 0.4, ())) == [0, 1, 2, 3]  # one above: nothing to exclude
    assert kept(exclude_top_choices(LOGPROBS, key, 0.0, 0.1, ())) == [0, 1, 2, 3]  # probability 0: never


def sample_many(params: SamplingParams, n: int = 200) -> list[int]:
    sampler, _ = make_sampling(params, [])
    return [int(sampler(LOGPROBS).item()) for _ in range(n)]


def test_requests_sample_only_what_xtc_leaves_seeded_or_not() -> None:
    common = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "xtc_probability": 1.0, "xtc_threshold": 0.1}
    assert set(sample_many(SamplingParams(**common))) == {2, 3}  # type: ignore[arg-type]
    seeded = SamplingParams(**common, seed=11)  # type: ignore[arg-type]
    draws = sample_many(seeded)
    assert set(draws) == {2, 3} and draws == sample_many(seeded)  # its own key: the same draws again
    exempt = SamplingParams(**common, xtc_exempt=(0,))  # type: ignore[arg-type]
    assert 0 in sample_many(exempt)  # the likeliest token is the end of the reply: it stays
    half = SamplingParams(**{**common, "xtc_probability": 0.5}, seed=3)  # type: ignore[arg-type]
    assert {0, 1} & set(sample_many(half))  # a coin: some steps keep the top choices
    assert set(sample_many(SamplingParams(**{**common, "xtc_probability": 0.0}))) >= {0, 1}
