"""What a prompt token costs to prefill, as the engine measures it from its replies (gpu/stats.py):
the figure the prompt cache weighs an SSD restore against (PrefixCache._pays)."""

from __future__ import annotations

import pytest

from mlxd.engine.gpu.stats import PREFILL_SAMPLE, Stats


def test_replies_mostly_served_from_the_cache_say_nothing_and_the_rest_are_averaged() -> None:
    stats = Stats()
    stats.prefilled(PREFILL_SAMPLE - 1, 1000.0)  # one step's time for a few tokens: not prefill's pace
    assert stats.prefill_cost() is None and stats.prefilled_tokens == 0
    stats.prefilled(2 * PREFILL_SAMPLE, 100.0)
    assert stats.prefill_cost() is None  # too few tokens yet
    stats.prefilled(2 * PREFILL_SAMPLE, 300.0)
    assert stats.prefill_cost() == pytest.approx(0.4 / (4 * PREFILL_SAMPLE))
