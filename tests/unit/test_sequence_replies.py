"""Every reply to a job goes through its Sequence (mlxd/engine/gpu/sequence.py), whatever became
of it: the events and counters of a job dropped while queued, refused, abandoned at shutdown."""

from __future__ import annotations

import re
from pathlib import Path

from mlxd.engine.gpu.job import Job, PrefillGroup, SamplingParams
from mlxd.engine.gpu.sequence import Sequence
from mlxd.engine.gpu.stats import Stats
from mlxd.protocol.events import Done, Event, Failed

GPU = Path(__file__).resolve().parents[2] / "mlxd" / "engine" / "gpu"


class FakeTicket:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.is_cancelled = False

    def emit(self, event: Event) -> None:
        self.events.append(event)


class FakeTokenizer:
    detokenizer = None


def sequence(prompt_len: int = 7, max_tokens: int = 5, group: PrefillGroup | None = None) -> tuple[Sequence, FakeTicket]:
    ticket = FakeTicket()
    job = Job(list(range(prompt_len)), max_tokens, SamplingParams(), [], ticket, group=group)  # type: ignore[arg-type]
    return Sequence(job, FakeTokenizer(), set()), ticket


def test_a_job_dropped_while_queued_is_answered_cancelled_and_counted() -> None:
    seq, ticket = sequence()
    stats = Stats()
    seq.drop(stats)
    assert ticket.events == [Done("cancelled", 7, 0)]
    assert (stats.num_cancelled, stats.last_finish_reason) == (1, None)  # not a finished request's figures


def test_a_refused_job_fails_with_the_default_status_and_is_counted() -> None:
    seq, ticket = sequence()
    stats = Stats()
    seq.fail(stats, "no room")
    assert ticket.events == [Failed("no room", 500, "generation_failed")] and stats.num_failed == 1


def test_a_job_abandoned_at_shutdown_gets_the_event_and_no_count() -> None:
    seq, ticket = sequence()
    stop = Failed("The engine is shutting down.", 503, "engine_stopping")
    seq.abandon(stop)
    assert ticket.events == [stop] and seq.is_finished


def test_what_the_scheduler_reads_of_a_sequence() -> None:
    seq, _ = sequence(100, 28)
    assert (seq.kv_need, seq.group_size, seq.is_cancelled) == (128, 1, False)
    assert sequence(group=PrefillGroup(3, 6))[0].group_size == 3


def test_start_sets_the_cached_tokens_and_restarts_the_clock() -> None:
    seq, _ = sequence()
    made_at = seq.clock.started_at
    seq.start(4)
    assert seq.cached == 4 and seq.clock.started_at >= made_at and seq.clock.last_at == seq.clock.started_at


def test_only_the_sequence_emits_on_a_ticket() -> None:
    emitters = [p.name for p in GPU.glob("*.py") if re.search(r"ticket\.emit\(", p.read_text())]
    assert emitters == ["sequence.py"]


def test_the_grown_history_is_the_history_kept_in_one_list() -> None:
    seq, _ = sequence(prompt_len=4, max_tokens=50)
    grown = seq.grown_history()
    assert grown == seq.history == [0, 1, 2, 3]
    for token in (9, 8, 7):
        seq.generated.append(token)
        assert seq.grown_history() is grown and grown == seq.history  # the same list, grown
    assert grown == [0, 1, 2, 3, 9, 8, 7]
