"""The lane choice and KV admission (mlxd/engine/gpu/scheduling.py), and the default reply budget."""

from __future__ import annotations

import pytest

from mlxd.engine.gpu.scheduling import KvLedger, LaneState, choose_lane, kv_tokens
from mlxd.engine.http.openai_requests import resolve_max_tokens


def state(width: int = 8, serial: bool = False, rows: int = 0, free: int = 10_000, behind: int = 0) -> LaneState:
    return LaneState(width=width, serial_busy=serial, batch_rows=rows, kv_free=free, behind=behind)


def test_a_lone_job_on_an_idle_engine_takes_the_serial_lane() -> None:
    assert choose_lane(100, state()) == "serial"


def test_jobs_arriving_together_on_an_idle_engine_all_take_the_batch_lane() -> None:
    # One batched prefill for the burst, rather than the first prefilling alone while the rest wait.
    assert choose_lane(100, state(behind=3)) == "batch"
    assert choose_lane(100, state(rows=3, behind=0)) == "batch"  # the burst's last joins the others
    assert choose_lane(100, state(width=1, behind=3)) == "serial"  # width 1 has no batch lane


def test_a_job_arriving_while_the_serial_lane_runs_joins_the_batch() -> None:
    assert choose_lane(100, state(serial=True)) == "batch"


def test_a_job_arriving_while_rows_decode_joins_them_even_if_the_serial_lane_is_free() -> None:
    assert choose_lane(100, state(rows=3)) == "batch"


def test_width_one_keeps_to_the_serial_lane_and_queues_behind_it() -> None:
    assert choose_lane(100, state(width=1)) == "serial"
    assert choose_lane(100, state(width=1, serial=True)) is None


@pytest.mark.parametrize(("serial", "rows"), [(True, 7), (False, 8)])
def test_a_full_width_makes_the_job_wait(serial: bool, rows: int) -> None:
    assert choose_lane(100, state(width=8, serial=serial, rows=rows)) is None
    assert choose_lane(100, state(width=9, serial=serial, rows=rows)) == "batch"


def test_a_job_whose_kv_does_not_fit_what_is_free_waits() -> None:
    assert choose_lane(501, state(rows=2, free=500)) is None
    assert choose_lane(500, state(rows=2, free=500)) == "batch"
    assert choose_lane(501, state(free=500)) is None  # even on an idle lane: the ledger is the judge


def test_kv_tokens_books_the_prompt_and_every_token_it_may_generate() -> None:
    assert kv_tokens(211, 128) == 339


def test_the_ledger_books_and_releases_and_knows_what_can_never_fit() -> None:
    ledger = KvLedger(1000)
    assert ledger.can_ever_fit(1000) and not ledger.can_ever_fit(1001)
    ledger.book(600)
    assert ledger.free == 400
    ledger.book(300)
    ledger.release(600)
    assert (ledger.booked, ledger.free) == (300, 700)
    ledger.release(5000)  # never below zero, whatever a bug releases twice
    assert ledger.booked == 0


def test_without_max_tokens_a_reply_may_run_to_the_kv_budget_when_it_ends_before_the_window() -> None:
    assert resolve_max_tokens(None, 100, 8192, None, kv_budget=2048) == 1948
    assert resolve_max_tokens(None, 100, 1024, None, kv_budget=2048) == 924
    assert resolve_max_tokens(None, 100, 8192, 16, kv_budget=2048) == 16
    assert resolve_max_tokens(None, 3000, 8192, None, kv_budget=2048) == 1  # refused later as never fitting
    assert resolve_max_tokens(500, 100, 8192, None, kv_budget=2048) == 500  # an explicit one is the caller's
