"""Sampler construction (mlxd/engine/gpu/sampling.py): shared objects for the batch lane, keys for seeds."""

from __future__ import annotations

import mlx.core as mx

from mlxd.engine.gpu.job import SamplingParams
from mlxd.engine.gpu.sampling import make_sampling


def test_requests_with_equal_parameters_share_one_sampler_so_the_batch_samples_them_in_one_call() -> None:
    a, _ = make_sampling(SamplingParams(temperature=0.7, top_p=0.9), [])
    b, _ = make_sampling(SamplingParams(temperature=0.7, top_p=0.9), [])
    c, _ = make_sampling(SamplingParams(temperature=0.8, top_p=0.9), [])
    assert a is b
    assert a is not c


def test_greedy_requests_share_the_greedy_sampler_seeded_or_not() -> None:
    a, _ = make_sampling(SamplingParams(temperature=0.0), [])
    b, _ = make_sampling(SamplingParams(temperature=0.0, seed=5), [])
    assert a is b


def draws(sampler, logprobs: mx.array, n: int) -> list[int]:  # type: ignore[no-untyped-def]
    return [int(sampler(logprobs).item()) for _ in range(n)]


def test_a_seeded_sampler_draws_the_same_tokens_whatever_else_uses_the_global_generator() -> None:
    logprobs = mx.log(mx.softmax(mx.arange(50, dtype=mx.float32) / 10))[None]
    first, _ = make_sampling(SamplingParams(temperature=1.0, seed=42), [])
    expected = draws(first, logprobs, 20)
    second, _ = make_sampling(SamplingParams(temperature=1.0, seed=42), [])
    got = []
    for _ in range(20):
        mx.random.uniform(shape=(3,))  # other rows drawing from MLX's global generator meanwhile
        got += draws(second, logprobs, 1)
    assert got == expected
    other, _ = make_sampling(SamplingParams(temperature=1.0, seed=43), [])
    assert draws(other, logprobs, 20) != expected


def test_a_seeded_sampler_applies_top_k() -> None:
    logprobs = mx.log(mx.softmax(mx.arange(50, dtype=mx.float32)))[None]
    sampler, _ = make_sampling(SamplingParams(temperature=5.0, top_k=2, seed=1), [])
    assert set(draws(sampler, logprobs, 30)) <= {48, 49}
