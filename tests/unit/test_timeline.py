"""The timeline behind the web page's charts: tokens spread over the decode, medians, the window."""

from __future__ import annotations

import pytest

from mlxd.supervisor.http.timeline import Timeline


def test_tokens_spread_over_the_buckets_the_decode_spanned() -> None:
    timeline = Timeline(step_s=2.0, num_buckets=10)
    timeline.record("m", end=110.0, completion_tokens=60, decode_s=6.0, ttft_at=104.0, ttft_ms=250.0)
    view = timeline.view(now=111.0)
    assert view.end == 112.0 and view.buckets == 10 and view.step_s == 2.0
    tokens = view.models["m"].completion_tokens
    # buckets [92..112): decode ran 104..110, 10 tokens a second: 20 in each of [104,106), [106,108), [108,110)
    assert tokens == [0, 0, 0, 0, 0, 0, 20, 20, 20, 0]
    assert view.models["m"].requests == [0] * 9 + [1]  # ended at 110
    assert view.models["m"].ttft_ms == [None] * 6 + [250.0] + [None] * 3


def test_ttft_is_the_median_of_the_bucket() -> None:
    timeline = Timeline(step_s=1.0, num_buckets=5)
    for ttft in (10.0, 30.0, 20.0):
        timeline.record("m", end=3.5, completion_tokens=1, decode_s=0.0, ttft_at=3.2, ttft_ms=ttft)
    view = timeline.view(now=3.9)
    assert view.models["m"].ttft_ms[-1] == 20.0
    assert view.models["m"].completion_tokens[-1] == 3  # no decode time: all in the end's bucket


def test_old_buckets_leave_the_window_and_never_overwrite_new_ones() -> None:
    timeline = Timeline(step_s=1.0, num_buckets=4)
    timeline.record("m", end=0.5, completion_tokens=5, decode_s=0.0, ttft_at=None, ttft_ms=None)
    assert timeline.view(now=0.5).models["m"].completion_tokens == [0, 0, 0, 5]
    assert timeline.view(now=4.5).models["m"].completion_tokens == [0, 0, 0, 0]  # scrolled out
    timeline.record("m", end=4.5, completion_tokens=7, decode_s=0.0, ttft_at=0.2, ttft_ms=99.0)  # same slot as 0.x
    view = timeline.view(now=4.5).models["m"]
    assert view.completion_tokens == [0, 0, 0, 7]
    assert view.ttft_ms == [None] * 4  # its first token, 4 s ago, is older than the window


@pytest.mark.parametrize("decode_s", [0.5, 3.0, 100.0])
def test_every_token_in_the_window_is_counted_once(decode_s: float) -> None:
    timeline = Timeline(step_s=2.0, num_buckets=300)
    timeline.record("m", end=1000.3, completion_tokens=90, decode_s=decode_s, ttft_at=None, ttft_ms=None)
    assert sum(timeline.view(now=1000.3).models["m"].completion_tokens) == pytest.approx(90, abs=0.1)


def test_cached_tokens_and_paused_requests_count_where_the_requests_ended() -> None:
    timeline = Timeline(step_s=1.0, num_buckets=3)
    timeline.record("m", end=1.5, completion_tokens=4, decode_s=0.5, ttft_at=1.0, ttft_ms=5.0, cached_tokens=300)
    timeline.record("m", end=2.5, completion_tokens=4, decode_s=2.0, ttft_at=0.5, ttft_ms=5.0, paused=2)
    timeline.record("m", end=2.6, completion_tokens=4, decode_s=0.1, ttft_at=2.5, ttft_ms=5.0, cached_tokens=7)
    view = timeline.view(now=2.9).models["m"]
    assert view.cached_tokens == [0, 300, 7]
    assert view.paused == [0, 0, 1]  # requests paused on the way, not pauses
