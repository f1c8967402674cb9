"""Which prompts starting together share a prefill (mlxd/engine/gpu/sharing.py), without MLX work."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxd.engine.gpu.sharing import (
    MIN_SHARED_TOKENS,
    Cluster,
    clusters,
    join_target,
    shareable,
    uniform_start,
)

M = MIN_SHARED_TOKENS


def tokens(*parts: range | list[int]) -> np.ndarray:
    return np.asarray([t for part in parts for t in part], dtype=np.int64)


SYSTEM = range(1000, 1000 + 3 * M)  # a long shared system prompt


def test_requests_with_one_long_system_prompt_form_one_group_sharing_all_of_it() -> None:
    prompts = [tokens(SYSTEM, [i, i + 1, i + 2]) for i in range(5)]
    assert clusters(prompts) == [Cluster([0, 1, 2, 3, 4], 3 * M)]


def test_prompts_that_differ_early_go_their_own_ways() -> None:
    prompts = [tokens([7, 8], range(i * 10_000, i * 10_000 + 2 * M)) for i in range(3)]
    assert clusters(prompts) == [Cluster([0], 0), Cluster([1], 0), Cluster([2], 0)]


def test_a_prefix_shorter_than_the_minimum_is_not_shared() -> None:
    a, b = tokens(range(M - 1), [1, 2, 3]), tokens(range(M - 1), [4, 5, 6])
    assert clusters([a, b]) == [Cluster([0], 0), Cluster([1], 0)]
    assert clusters([tokens(range(M), [1]), tokens(range(M), [2])]) == [Cluster([0, 1], M)]


def test_identical_prompts_share_all_but_their_last_token() -> None:
    p = tokens(range(2 * M))
    assert clusters([p, p.copy(), p.copy()]) == [Cluster([0, 1, 2], 2 * M - 1)]


def test_a_latecomer_sharing_little_of_a_long_group_prefix_goes_alone() -> None:
    long_a, long_b = tokens(range(4 * M), [1]), tokens(range(4 * M), [2])
    short = tokens(range(M), [9] * M)
    assert clusters([long_a, long_b, short]) == [Cluster([0, 1], 4 * M), Cluster([2], 0)]
    # Sharing at least half of it, it joins and the group shares what all three do.
    half = tokens(range(2 * M), [9] * M)
    assert clusters([long_a, long_b, half]) == [Cluster([0, 1, 2], 2 * M)]


def test_each_prompt_joins_the_group_it_shares_most_with() -> None:
    a = [tokens(range(M), range(50_000, 50_000 + 2 * M), [i]) for i in range(2)]
    b = [tokens(range(M), range(60_000, 60_000 + 2 * M), [i]) for i in range(2)]
    assert clusters([a[0], b[0], a[1], b[1]]) == [Cluster([0, 2], 3 * M), Cluster([1, 3], 3 * M)]


def test_a_latecomer_joins_a_prefill_under_way_and_may_shorten_it_to_what_is_run() -> None:
    group = tokens(range(4 * M))
    assert join_target(group, 4 * M, M, tokens(range(4 * M), [5])) == 4 * M
    assert join_target(group, 4 * M, M, tokens(range(3 * M), [5])) == 3 * M
    assert join_target(group, 4 * M, 3 * M + 1, tokens(range(3 * M), [5])) is None  # already past it
    assert join_target(group, 4 * M, 0, tokens(range(M), [5])) is None  # less than half


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=3 * M), min_size=1, max_size=8))
def test_every_prompt_in_exactly_one_group_whose_members_all_share_its_prefix(raw: list[list[int]]) -> None:
    # Few distinct tokens and long runs: many prompts share long prefixes.
    prompts = [tokens([t for t in p for _ in range(4)]) for p in raw]
    found = clusters(prompts, min_shared=8)
    assert sorted(i for c in found for i in c.members) == list(range(len(prompts)))
    for c in found:
        if len(c.members) == 1:
            assert c.shared == 0
            continue
        assert c.shared >= 8
        first = prompts[c.members[0]]
        for i in c.members:
            assert shareable(first, prompts[i]) >= c.shared and len(prompts[i]) > c.shared


def test_rows_start_from_a_short_cached_prefix_only_when_all_find_about_as_much() -> None:
    assert uniform_start([28, 28, 27, 28])  # a chat preamble, a token more for some
    assert uniform_start([40, 50])  # within a quarter of the shortest
    assert not uniform_start([40, 51])  # one would pad the other by more
    assert not uniform_start([28, 28, 0])  # one finds nothing: the others would pad it
    assert not uniform_start([12, 12, 12])  # too short to be worth a copy
    assert not uniform_start([28]) and not uniform_start([])  # a lone row has its own rule
