"""The GPU thread's scheduler (mlxd/engine/gpu/scheduler.py): queue order, KV booking, lane
choice and refusals, against a model of the lanes, without MLX."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from mlxd.engine.gpu.scheduler import Drop, LaneLoad, Pause, Refuse, Scheduler, Start
from mlxd.engine.gpu.scheduling import LaneName


@dataclass(eq=False)
class FakeJob:
    kv_need: int
    group_size: int = 1
    is_cancelled: bool = False
    name: int = 0
    priority: int = 0


IDLE = LaneLoad(serial_busy=False, batch_rows=0)


def queued(scheduler: Scheduler[FakeJob], *jobs: FakeJob) -> Scheduler[FakeJob]:
    for job in jobs:
        scheduler.enqueue(job)
    return scheduler


def test_a_lone_job_starts_in_the_serial_lane_and_books_its_kv() -> None:
    job = FakeJob(300)
    s = queued(Scheduler(4, 1000), job)
    assert s.plan(IDLE) == [Start(job, "serial")]
    assert (s.kv.booked, s.num_waiting) == (300, 0)
    s.release(job)
    assert s.kv.booked == 0


def test_a_burst_on_an_idle_engine_all_takes_the_batch_lane() -> None:
    jobs = [FakeJob(100) for _ in range(3)]
    assert Scheduler(4, 1000).plan(IDLE) == []
    assert queued(Scheduler(4, 1000), *jobs).plan(IDLE) == [Start(j, "batch") for j in jobs]


def test_a_choice_of_n_takes_the_batch_lane_even_alone() -> None:
    job = FakeJob(100, group_size=3)
    assert queued(Scheduler(4, 1000), job).plan(IDLE) == [Start(job, "batch")]


def test_the_first_job_that_does_not_fit_holds_back_the_rest() -> None:
    first, big, small = FakeJob(300), FakeJob(800), FakeJob(10)
    s = queued(Scheduler(4, 1000), first, big, small)
    assert s.plan(IDLE) == [Start(first, "batch")]  # two behind it: a burst
    assert s.num_waiting == 2 and s.kv.booked == 300  # `small` would fit, but waits behind `big`


def test_width_one_queues_behind_the_serial_lane() -> None:
    a, b = FakeJob(10), FakeJob(10)
    s = queued(Scheduler(1, 1000), a, b)
    assert s.plan(IDLE) == [Start(a, "serial")]
    assert s.plan(LaneLoad(serial_busy=True, batch_rows=0)) == []
    s.release(a)
    assert s.plan(IDLE) == [Start(b, "serial")]


def test_a_cancelled_job_at_the_head_is_dropped_and_the_next_considered() -> None:
    gone, next_one = FakeJob(10, is_cancelled=True), FakeJob(10)
    s = queued(Scheduler(4, 1000), gone, next_one)
    assert s.plan(IDLE) == [Drop(gone), Start(next_one, "serial")]
    assert s.kv.booked == 10


def test_stopping_drops_every_waiting_job() -> None:
    jobs = [FakeJob(10), FakeJob(20)]
    s = queued(Scheduler(4, 1000), *jobs)
    assert s.plan(IDLE, is_stopping=True) == [Drop(j) for j in jobs]
    assert s.kv.booked == 0


def test_a_job_that_cannot_fit_with_nothing_running_is_refused() -> None:
    job = FakeJob(1001)
    (decision,) = queued(Scheduler(4, 1000), job).plan(IDLE)
    assert decision == Refuse(job, "The request needs 1001 tokens of KV; the budget is 1000.")


def test_it_waits_while_something_runs() -> None:
    assert queued(Scheduler(4, 1000), FakeJob(1001)).plan(LaneLoad(serial_busy=False, batch_rows=1)) == []


def test_refusal_before_queueing_says_what_the_request_needs() -> None:
    s: Scheduler[FakeJob] = Scheduler(4, 1000)
    assert s.refusal(900, 100) is None
    err = s.refusal(901, 100)
    assert err is not None and (err.status, err.code, err.param) == (400, "kv_budget_exceeded", "messages")
    assert err.message.startswith("This request needs 1001 tokens of KV cache (a 901-token prompt plus max_tokens 100)")
    assert "`max_context`" in err.message and "[models.NAME]" in err.message  # what a `mlxd serve` user can set
    clamped = Scheduler[FakeJob](4, 1000, "a smaller `batch` fits longer prompts").refusal(901, 100)
    assert clamped is not None and "; a smaller `batch` fits longer prompts (an engine run alone" in clamped.message


def test_take_all_empties_the_queue_in_order() -> None:
    jobs = [FakeJob(10), FakeJob(20)]
    s = queued(Scheduler(4, 1000), *jobs)
    assert s.take_all() == jobs and s.num_waiting == 0


# --- properties against a model of the lanes ----------------------------------------------

job_specs = st.tuples(st.integers(1, 600), st.sampled_from([1, 1, 1, 2, 3]), st.booleans())
# Each event: jobs arriving, then a turn, then some running jobs end (a bit mask over them).
events = st.lists(st.tuples(st.lists(job_specs, max_size=4), st.integers(0, 2**8 - 1)), min_size=1, max_size=25)


class LaneModel:
    """What the lanes hold: the serial lane's one job and the batch lane's rows."""

    def __init__(self) -> None:
        self.serial: FakeJob | None = None
        self.batch: list[FakeJob] = []

    @property
    def load(self) -> LaneLoad:
        return LaneLoad(self.serial is not None, len(self.batch))

    @property
    def running(self) -> list[FakeJob]:
        return ([self.serial] if self.serial is not None else []) + self.batch

    def start(self, job: FakeJob, lane: LaneName) -> None:
        if lane == "serial":
            assert self.serial is None, "the serial lane runs one job"
            self.serial = job
        else:
            self.batch.append(job)

    def end(self, job: FakeJob) -> None:
        if self.serial is job:
            self.serial = None
        else:
            self.batch.remove(job)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.integers(200, 2000), events)
def test_never_over_the_budget_or_the_width_and_first_come_first_started(
    width: int, budget: int, timeline: list[tuple[list[tuple[int, int, bool]], int]]
) -> None:
    s: Scheduler[FakeJob] = Scheduler(width, budget)
    lanes = LaneModel()
    arrived: list[FakeJob] = []
    decided: list[FakeJob] = []
    for arrivals, ends in timeline:
        for need, group, cancelled in arrivals:
            job = FakeJob(need, group, cancelled, name=len(arrived))
            arrived.append(job)
            s.enqueue(job)
        for d in s.plan(lanes.load):
            decided.append(d.job)
            if isinstance(d, Start):
                lanes.start(d.job, d.lane)
                assert not d.job.is_cancelled
            elif isinstance(d, Refuse):
                assert d.job.kv_need > budget and not lanes.running
            else:
                assert d.job.is_cancelled
        assert sum(j.kv_need for j in lanes.running) == s.kv.booked <= budget
        assert len(lanes.running) <= width
        for i, job in enumerate(list(lanes.running)):
            if ends >> i & 1:
                lanes.end(job)
                s.release(job)
    # FIFO: jobs leave the queue in the order they came, and what is left is the tail.
    assert decided == arrived[: len(decided)]
    assert s.take_all() == arrived[len(decided):]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(200, 2000), st.lists(job_specs, min_size=1, max_size=12))
def test_with_the_lanes_emptied_each_turn_every_job_is_decided(
    width: int, budget: int, specs: list[tuple[int, int, bool]]
) -> None:
    s: Scheduler[FakeJob] = Scheduler(width, budget)
    for need, group, cancelled in specs:
        s.enqueue(FakeJob(need, group, cancelled))
    for _ in specs:  # each turn at least the head is decided once the lanes are empty
        for d in s.plan(IDLE):
            if isinstance(d, Start):
                s.release(d.job)
    assert s.num_waiting == 0 and s.kv.booked == 0


def test_a_waiting_head_is_not_overtaken_by_later_jobs_that_would_fit() -> None:
    head, later = FakeJob(900), FakeJob(50)
    s = queued(Scheduler(4, 1000), head, later)
    running = FakeJob(200)
    s.kv.book(running.kv_need)
    assert s.plan(LaneLoad(serial_busy=False, batch_rows=1)) == []
    s.release(running)
    assert s.plan(IDLE) == [Start(head, "batch"), Start(later, "batch")]


def test_the_queue_runs_by_priority_then_arrival() -> None:
    jobs = [FakeJob(100, name=i, priority=p) for i, p in enumerate([5, 0, 5, -3, 0, 5])]
    s = queued(Scheduler(1, 10_000), *jobs)  # one row at a time: each plan starts the head alone
    order = []
    for _ in jobs:
        [start] = s.plan(IDLE)
        assert isinstance(start, Start)
        order.append((start.job.priority, start.job.name))
        s.release(start.job)
    assert order == [(-3, 3), (0, 1), (0, 4), (5, 0), (5, 2), (5, 5)]


def test_an_urgent_job_waits_only_for_the_rows_running_not_for_the_queue() -> None:
    running, background = FakeJob(600), [FakeJob(300, name=i, priority=10) for i in range(3)]
    s = queued(Scheduler(4, 1000), running)
    assert s.plan(IDLE) == [Start(running, "serial")]
    queued(s, *background)
    busy = LaneLoad(serial_busy=True, batch_rows=1)
    assert [d.job for d in s.plan(busy)] == background[:1]  # 300 of the 400 free: the rest wait
    urgent = FakeJob(100, name=9)
    queued(s, urgent)
    assert [j.name for j in s.take_all()] == [9, 1, 2]  # ahead of the background ones that waited


# --- pausing for a more urgent job ---------------------------------------------------------


def running_in_batch(s: Scheduler[FakeJob], *jobs: FakeJob) -> LaneLoad[FakeJob]:
    """`jobs` running in the batch lane (booked), all of them pausable."""
    for job in jobs:
        s.kv.book(job.kv_need)
    return LaneLoad(False, len(jobs), tuple((j, "batch") for j in jobs), min((j.priority for j in jobs), default=None))


def test_a_full_batch_pauses_its_least_urgent_row_for_a_more_urgent_job() -> None:
    s: Scheduler[FakeJob] = Scheduler(3, 10_000)
    rows = [FakeJob(100, name=0, priority=5), FakeJob(100, name=1, priority=10), FakeJob(100, name=2, priority=5)]
    load = running_in_batch(s, *rows)
    urgent = FakeJob(100, name=9, priority=0)
    queued(s, urgent)
    # it starts alone in the serial lane (more urgent than all that runs), then joins the batch
    assert s.plan(load) == [Pause(rows[1], "batch"), Start(urgent, "serial")]
    assert s.kv.booked == 300 and s.take_all() == [rows[1]]  # it waits again, booked no more


def test_a_job_more_urgent_than_all_that_runs_takes_the_free_serial_lane_beside_the_batch() -> None:
    s: Scheduler[FakeJob] = Scheduler(8, 10_000)
    load = running_in_batch(s, FakeJob(100, priority=10), FakeJob(100, priority=5))
    urgent, same, choices = FakeJob(100, priority=4), FakeJob(100, priority=5), FakeJob(100, priority=0, group_size=2)
    assert queued(s, urgent).plan(load) == [Start(urgent, "serial")]
    # no more urgent than the most urgent running row: the batch lane
    assert queued(s, same).plan(load) == [Start(same, "batch")]
    # a choice of n is prefilled once in the batch lane, however urgent
    assert queued(s, choices).plan(load) == [Start(choices, "batch")]
    # the serial lane busy: the batch lane
    busy = LaneLoad(True, 2, (), 5)
    other = FakeJob(100, priority=0)
    assert queued(s, other).plan(busy) == [Start(other, "batch")]
    # two urgent ones at once: the first alone, the second with the batch
    a, b = FakeJob(100, priority=0, name=1), FakeJob(100, priority=0, name=2)
    assert queued(s, a, b).plan(load) == [Start(a, "serial"), Start(b, "batch")]


def test_among_equally_urgent_rows_the_last_started_is_paused() -> None:
    s: Scheduler[FakeJob] = Scheduler(2, 10_000)
    rows = [FakeJob(100, name=0, priority=5), FakeJob(100, name=1, priority=5)]
    urgent = FakeJob(100, priority=1)
    assert queued(s, urgent).plan(running_in_batch(s, *rows))[0] == Pause(rows[1], "batch")


def test_a_job_of_the_same_priority_waits_and_pauses_nothing() -> None:
    s: Scheduler[FakeJob] = Scheduler(2, 10_000)
    load = running_in_batch(s, FakeJob(100, priority=3), FakeJob(100, priority=3))
    assert queued(s, FakeJob(100, priority=3)).plan(load) == []
    assert queued(Scheduler[FakeJob](2, 10_000), FakeJob(100, priority=4)).plan(load) == []


def test_a_job_short_of_kv_pauses_as_few_rows_as_make_room_or_none() -> None:
    s: Scheduler[FakeJob] = Scheduler(8, 1000)
    rows = [FakeJob(300, name=0, priority=9), FakeJob(300, name=1, priority=8), FakeJob(300, name=2, priority=0)]
    load = running_in_batch(s, *rows)
    urgent = FakeJob(500, name=9, priority=1)
    assert queued(s, urgent).plan(load) == [Pause(rows[0], "batch"), Pause(rows[1], "batch"), Start(urgent, "batch")]
    # 900 would be needed, but only the two less urgent rows may go: nothing is paused for nothing.
    s2: Scheduler[FakeJob] = Scheduler(8, 1000)
    assert queued(s2, FakeJob(800, priority=1)).plan(running_in_batch(s2, *rows)) == []
    assert s2.kv.booked == 900


def test_the_serial_lane_row_is_paused_at_width_one() -> None:
    s: Scheduler[FakeJob] = Scheduler(1, 10_000)
    background = FakeJob(100, priority=10)
    s.kv.book(100)
    urgent = FakeJob(100, priority=0)
    plan = queued(s, urgent).plan(LaneLoad(True, 0, ((background, "serial"),)))
    assert plan == [Pause(background, "serial"), Start(urgent, "serial")]


def test_a_paused_job_waits_ahead_of_its_priority_and_behind_more_urgent_ones() -> None:
    s: Scheduler[FakeJob] = Scheduler(1, 10_000)
    waiting = [FakeJob(100, name=1, priority=10), FakeJob(100, name=2, priority=0)]
    background = FakeJob(100, name=0, priority=10)
    s.kv.book(100)
    queued(s, *waiting)
    assert s.plan(LaneLoad(True, 0, ((background, "serial"),))) == [Pause(background, "serial"), Start(waiting[1], "serial")]
    assert [j.name for j in s.take_all()] == [0, 1]  # it came before the other background job


def test_a_cancelled_head_pauses_nothing() -> None:
    s: Scheduler[FakeJob] = Scheduler(1, 10_000)
    s.kv.book(100)
    gone = FakeJob(100, priority=0, is_cancelled=True)
    assert queued(s, gone).plan(LaneLoad(True, 0, ((FakeJob(100, priority=9), "serial"),))) == [Drop(gone)]


priority_specs = st.tuples(st.integers(1, 600), st.integers(0, 3))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5), st.integers(600, 2000),
       st.lists(st.tuples(st.lists(priority_specs, max_size=4), st.integers(0, 2**8 - 1)), min_size=1, max_size=25))
def test_pausing_keeps_the_budget_and_width_and_only_a_more_urgent_job_pauses_another(
    width: int, budget: int, timeline: list[tuple[list[tuple[int, int]], int]]
) -> None:
    s: Scheduler[FakeJob] = Scheduler(width, budget)
    lanes = LaneModel()
    arrived = 0
    for arrivals, ends in timeline:
        for need, priority in arrivals:
            s.enqueue(FakeJob(need, name=arrived, priority=priority))
            arrived += 1
        pausable = tuple((j, "serial" if j is lanes.serial else "batch") for j in lanes.running)
        paused: list[FakeJob] = []
        for d in s.plan(LaneLoad(lanes.serial is not None, len(lanes.batch), pausable)):
            if isinstance(d, Pause):
                lanes.end(d.job)
                paused.append(d.job)
            elif isinstance(d, Start):
                assert all(d.job.priority < p.priority for p in paused) or d.job not in paused
                lanes.start(d.job, d.lane)
        started = [j for j in lanes.running if j not in [p for _, p in enumerate(paused)]]
        for job in paused:  # each one paused made room for a strictly more urgent job that started
            assert job not in lanes.running
            assert any(r.priority < job.priority for r in started)
        assert sum(j.kv_need for j in lanes.running) == s.kv.booked <= budget
        assert len(lanes.running) <= width
        for i, job in enumerate(list(lanes.running)):
            if ends >> i & 1:
                lanes.end(job)
                s.release(job)
    everyone = lanes.running + s.take_all()
    assert sorted(j.name for j in everyone) == sorted(set(j.name for j in everyone))  # none lost, none twice
