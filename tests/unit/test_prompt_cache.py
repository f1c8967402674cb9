"""The single-slot prompt cache: prefix reuse, trimming, and what it refuses to keep."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load

from mlxd.engine.cache.prompt_cache import PromptCache, common_prefix_len


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([5], [6]) == 0


@pytest.fixture(scope="module")
def model(tiny_model: Path):  # type: ignore[no-untyped-def]
    return load(str(tiny_model))[0]


def fill(model, cache, tokens: list[int]) -> None:  # type: ignore[no-untyped-def]
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])


def test_reuses_the_shared_prefix_and_trims_the_rest(model) -> None:  # type: ignore[no-untyped-def]
    pc = PromptCache(model)
    cache, cached = pc.fetch([1, 2, 3, 4, 5])
    assert cached == 0
    fill(model, cache, [1, 2, 3, 4, 5, 6])  # prompt plus one generated token
    pc.store(cache, [1, 2, 3, 4, 5, 6])
    again, cached = pc.fetch([1, 2, 3, 9, 9])
    assert again is cache and cached == 3
    assert again[0].offset == 3


def test_keeps_at_least_one_prompt_token_to_run(model) -> None:  # type: ignore[no-untyped-def]
    pc = PromptCache(model)
    cache, _ = pc.fetch([1, 2, 3])
    fill(model, cache, [1, 2, 3])
    pc.store(cache, [1, 2, 3])
    _, cached = pc.fetch([1, 2, 3])
    assert cached == 2


def test_reused_cache_gives_the_same_logits_as_a_fresh_one(model) -> None:  # type: ignore[no-untyped-def]
    pc = PromptCache(model)
    cache, _ = pc.fetch([1, 2, 3, 4])
    fill(model, cache, [1, 2, 3, 4, 7, 8])
    pc.store(cache, [1, 2, 3, 4, 7, 8])
    reused, cached = pc.fetch([1, 2, 3, 4, 5, 6])
    warm = model(mx.array([1, 2, 3, 4, 5, 6][cached:])[None], cache=reused)[:, -1]
    cold = model(mx.array([1, 2, 3, 4, 5, 6])[None], cache=PromptCache(model).fetch([0])[0])[:, -1]
    assert mx.allclose(warm, cold, atol=1e-4).item()


def test_store_refuses_a_cache_that_claims_more_than_its_tokens(model) -> None:  # type: ignore[no-untyped-def]
    pc = PromptCache(model)
    cache, _ = pc.fetch([1, 2, 3])
    fill(model, cache, [1, 2, 3])
    pc.store(cache, [1, 2])  # offset 3 > 2 tokens: inconsistent, dropped
    _, cached = pc.fetch([1, 2, 3])
    assert cached == 0


def test_clear_drops_what_is_held(model) -> None:  # type: ignore[no-untyped-def]
    pc = PromptCache(model)
    cache, _ = pc.fetch([1, 2, 3])
    fill(model, cache, [1, 2, 3])
    pc.store(cache, [1, 2, 3])
    pc.clear()
    assert pc.fetch([1, 2, 3])[1] == 0


def test_a_prefix_below_the_wanted_share_is_not_used_and_stays_held(model) -> None:  # type: ignore[no-untyped-def]
    pc = PromptCache(model)
    cache, _ = pc.fetch([1, 2, 3, 4])
    fill(model, cache, [1, 2, 3, 4])
    pc.store(cache, [1, 2, 3, 4])
    fresh, cached = pc.fetch([1, 2, 9, 9, 9, 9], min_share=0.5)  # 2 of 6 shared: under half
    assert cached == 0 and fresh is not cache and fresh[0].offset == 0
    reused, cached = pc.fetch([1, 2, 3, 9], min_share=0.5)  # 3 of 4: the held cache, still there
    assert reused is cache and cached == 3


def test_a_miss_leaves_the_held_cache_for_a_later_request(model) -> None:  # type: ignore[no-untyped-def]
    pc = PromptCache(model)
    cache, _ = pc.fetch([1, 2, 3])
    fill(model, cache, [1, 2, 3])
    pc.store(cache, [1, 2, 3])
    assert pc.fetch([7, 8])[1] == 0
    assert pc.fetch([1, 2, 5]) == (cache, 2)
