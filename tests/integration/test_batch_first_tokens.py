"""The batch lane hands out a just-prefilled row's first token before it prefills newer arrivals
(mlxd/engine/gpu/batch_lane.py, FIRST_TOKEN_STEPS), in process on the tiny random model.

A burst whose last few requests miss the gather window would otherwise see its first part wait
for the late part's whole prefill before its first token (mlx-lm's generator hands out nothing
from a step that also prefills).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.gpu import batch_lane
from mlxd.engine.gpu.batch_lane import BatchLane
from mlxd.engine.gpu.job import Job, SamplingParams
from mlxd.engine.gpu.sequence import Sequence
from mlxd.engine.gpu.stats import Stats
from mlxd.engine.gpu.ticket import Ticket
from mlxd.engine.models.loaded_model import LoadedModel

MAX_TOKENS = 6


def sequences(tiny_loaded: LoadedModel, loop: asyncio.AbstractEventLoop, n: int, salt: int,
              priority: int = 0) -> list[Sequence]:
    """`n` greedy jobs with distinct 40-token prompts (nothing to share), no EOS."""
    rng = random.Random(salt)
    return [Sequence(Job([rng.randrange(1, tiny_loaded.vocab_size) for _ in range(40)], MAX_TOKENS,
                         SamplingParams(temperature=0.0), [], Ticket(loop), priority=priority), tiny_loaded.tokenizer, set())
            for _ in range(n)]


def burst_split_in_two(tiny_loaded: LoadedModel, loop: asyncio.AbstractEventLoop, late_priority: int = 5,
                       ) -> tuple[list[Sequence], list[Sequence], int]:
    """Two requests (priority 5) start and are prefilled in one step, two more (`late_priority`)
    arrive right after it; all run to the end. The first two, the late two, and the steps it took."""
    lane = BatchLane(tiny_loaded, Stats(), prefill_step=64, width=8, prompt_cache=PrefixCache(0))
    first = sequences(tiny_loaded, loop, 2, salt=1, priority=5)
    late = sequences(tiny_loaded, loop, 2, salt=2, priority=late_priority)
    for seq in first:
        lane.admit(seq)
    lane.step()  # the first two's prompts, all but their last tokens, in one chunk
    assert not any(seq.generated for seq in first)
    for seq in late:
        lane.admit(seq)
    steps, ended = 1, 0
    while ended < 4:
        ended += len(lane.step())
        steps += 1
        assert steps < 50, "the lane never finished"
    return first, late, steps


def test_rows_just_prefilled_get_their_first_token_before_later_arrivals_are_prefilled(
    tiny_loaded: LoadedModel, closed_loop: asyncio.AbstractEventLoop,
) -> None:
    first, late, _ = burst_split_in_two(tiny_loaded, closed_loop)
    for seq in first + late:
        assert len(seq.generated) == MAX_TOKENS and seq.finish_reason == "length"
    first_tokens = max(seq.clock.first_at or 0.0 for seq in first)
    late_started = min(seq.clock.started_at for seq in late)  # a lane starts its clock as it places it
    assert first_tokens < late_started


def test_without_the_hold_the_late_prefill_comes_first(
    tiny_loaded: LoadedModel, closed_loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the hold changes: with it off, mlx-lm's order puts the late prefill before the first
    two's first token (so the test above can fail)."""
    monkeypatch.setattr(batch_lane, "FIRST_TOKEN_STEPS", 0)
    first, late, _ = burst_split_in_two(tiny_loaded, closed_loop)
    first_tokens = min(seq.clock.first_at or 0.0 for seq in first)
    late_started = max(seq.clock.started_at for seq in late)
    assert late_started < first_tokens


def test_an_arrival_more_urgent_than_the_rows_it_would_wait_for_is_not_held(
    tiny_loaded: LoadedModel, closed_loop: asyncio.AbstractEventLoop,
) -> None:
    first, late, _ = burst_split_in_two(tiny_loaded, closed_loop, late_priority=-1)
    for seq in first + late:
        assert len(seq.generated) == MAX_TOKENS
    first_tokens = min(seq.clock.first_at or 0.0 for seq in first)
    late_started = max(seq.clock.started_at for seq in late)
    assert late_started < first_tokens
