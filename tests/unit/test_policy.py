"""The pool policy: admission, starts, eviction, idle TTLs, leases and the bounded queue."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxd.supervisor.engines.policy import (
    LIVE,
    Action,
    Admit,
    Close,
    CrashHistory,
    CrashLimits,
    EngineView,
    Limits,
    PoolView,
    Reject,
    Retire,
    Start,
    WaiterView,
    after_crash,
    can_queue,
    cooldown_s,
    forget_if_healthy,
    never_fits,
    next_deadline,
    plan,
    restart_delay_s,
    retry_after_s,
    spare_delay_s,
)

GIB = 1 << 30
NOW = 1000.0


def engine(model: str, state: str = "ready", gib: int = 4, **kw: Any) -> EngineView:
    return EngineView(model, state, gib * GIB, **kw)


def waiter(id: int, model: str, since: float = NOW, gib: int = 4, **kw: Any) -> WaiterView:
    return WaiterView(id, model, since, gib * GIB, **kw)


def pool(
    *engines: EngineView,
    waiters: tuple[WaiterView, ...] = (),
    budget_gib: int = 16,
    max_loaded: int | None = None,
    queue_timeout_s: float = 300.0,
    now: float = NOW,
    machine_leased: bool = False,
) -> PoolView:
    limits = Limits(budget_gib * GIB, max_loaded, queue_timeout_s=queue_timeout_s)
    return PoolView({e.model: e for e in engines}, list(waiters), limits, now, machine_leased)


def summary(actions: list[Action]) -> list[tuple[str, str | int]]:
    """Actions without their free-text reasons (a Reject keeps its reason: it is the status)."""
    out: list[tuple[str, str | int]] = []
    for a in actions:
        match a:
            case Admit(waiter=w):
                out.append(("admit", w))
            case Reject(waiter=w, reason=r):
                out.append((f"reject:{r}", w))
            case Start(model=m):
                out.append(("start", m))
            case Close(model=m):
                out.append(("close", m))
            case Retire(model=m):
                out.append(("retire", m))
    return out


def of_kind(actions: list[Action], kind: type) -> set[str | int]:
    return {key for name, key in summary(actions) if name == kind.__name__.lower()}


# Admission


def test_admits_every_waiter_of_a_ready_engine() -> None:
    view = pool(engine("a", in_flight=3), waiters=(waiter(1, "a"), waiter(2, "a")))
    assert summary(plan(view)) == [("admit", 1), ("admit", 2)]


@pytest.mark.parametrize(
    "a",
    [
        engine("a", state="starting"),
        engine("a", state="draining"),
        engine("a", state="stopping"),
        engine("a", state="stopped"),
        engine("a", state="failed"),
        engine("a", closing=True, in_flight=1),
        engine("a", leased=True),
    ],
    ids=["starting", "draining", "stopping", "stopped", "failed", "closing", "leased"],
)
def test_no_admission_unless_ready_open_and_not_leased(a: EngineView) -> None:
    assert not of_kind(plan(pool(a, waiters=(waiter(1, "a"),))), Admit)


def test_the_lease_holder_runs_while_others_queue() -> None:
    view = pool(
        engine("a", leased=True),
        waiters=(waiter(1, "a"), waiter(2, "a", holds_lease=True), waiter(3, "a")),
    )
    assert summary(plan(view)) == [("admit", 2)]


# Starting engines


@pytest.mark.parametrize("a", [None, engine("a", state="stopped"), engine("a", state="failed")])
def test_starts_a_model_that_fits(a: EngineView | None) -> None:
    engines = () if a is None else (a,)
    assert summary(plan(pool(*engines, waiters=(waiter(1, "a"),)))) == [("start", "a")]


@pytest.mark.parametrize("state", ["starting", "draining", "stopping"])
def test_waits_for_a_live_engine_rather_than_starting_another(state: str) -> None:
    assert plan(pool(engine("a", state=state), waiters=(waiter(1, "a"),))) == []


@pytest.mark.parametrize(
    ("budget_gib", "max_loaded", "need_gib", "starts"),
    [
        (8, None, 4, True),  # 4 + 4 == budget
        (8, None, 5, False),
        (16, 1, 4, False),  # memory to spare, but no slot
        (16, 2, 4, True),
    ],
)
def test_start_needs_memory_and_a_slot(
    budget_gib: int, max_loaded: int | None, need_gib: int, starts: bool
) -> None:
    view = pool(
        engine("a", in_flight=1),
        waiters=(waiter(1, "b", gib=need_gib),),
        budget_gib=budget_gib,
        max_loaded=max_loaded,
    )
    assert (("start", "b") in summary(plan(view))) is starts


def test_starts_models_oldest_first_while_they_fit() -> None:
    view = pool(
        waiters=(waiter(1, "b", since=NOW - 3), waiter(2, "a", since=NOW - 2), waiter(3, "c")),
        budget_gib=8,
    )
    assert summary(plan(view)) == [("start", "b"), ("start", "a")]


def test_a_more_urgent_waiter_starts_its_model_first() -> None:
    """Room for one model: the priority-0 request's model starts before an older priority-10
    one's, which waits; equal priorities keep arrival order."""
    view = pool(
        waiters=(waiter(1, "agent", since=NOW - 5, priority=10), waiter(2, "chat", since=NOW - 1)),
        budget_gib=4,
    )
    assert summary(plan(view)) == [("start", "chat")]
    tied = pool(waiters=(waiter(1, "a", since=NOW - 5, priority=3), waiter(2, "b", priority=3)), budget_gib=4)
    assert summary(plan(tied)) == [("start", "a")]
    urgent_behind = pool(waiters=(waiter(1, "a", since=NOW - 5), waiter(2, "b", priority=-1)), budget_gib=4)
    assert summary(plan(urgent_behind)) == [("start", "b")]


# Making room


def test_swap_retires_the_idle_engine_before_starting_the_next() -> None:
    waiting = (waiter(1, "b"),)
    assert summary(plan(pool(engine("a"), waiters=waiting, max_loaded=1))) == [
        ("close", "a"),
        ("retire", "a"),
    ]
    for state in ("draining", "stopping"):
        going = engine("a", state=state, closing=True)
        assert plan(pool(going, waiters=waiting, max_loaded=1)) == []
    gone = engine("a", state="stopped")
    assert summary(plan(pool(gone, waiters=waiting, max_loaded=1))) == [("start", "b")]


def test_swap_for_memory() -> None:
    view = pool(engine("a", gib=6), waiters=(waiter(1, "b", gib=6),), budget_gib=8)
    assert summary(plan(view)) == [("close", "a"), ("retire", "a")]


@pytest.mark.parametrize(
    ("need_gib", "victims"),
    [(4, {"old"}), (6, {"old", "mid"}), (8, {"old", "mid"}), (12, {"old", "mid", "new"})],
)
def test_least_recently_used_idle_engines_go_first(need_gib: int, victims: set[str]) -> None:
    engines = (
        engine("new", last_used=9),
        engine("old", last_used=1),
        engine("mid", last_used=5),
    )
    view = pool(*engines, waiters=(waiter(1, "x", gib=need_gib),), budget_gib=12)
    actions = plan(view)
    assert of_kind(actions, Close) == victims
    assert of_kind(actions, Retire) == victims
    assert not of_kind(actions, Start)


def test_idle_engines_go_before_busy_ones() -> None:
    busy = engine("busy", last_used=1, in_flight=2)
    view = pool(busy, engine("idle", last_used=9), waiters=(waiter(1, "x"),), max_loaded=2)
    assert summary(plan(view)) == [("close", "idle"), ("retire", "idle")]


def test_least_recently_used_busy_engine_when_none_is_idle() -> None:
    engines = (engine("a", last_used=9, in_flight=1), engine("b", last_used=1, in_flight=1))
    view = pool(*engines, waiters=(waiter(1, "x"),), max_loaded=2)
    assert summary(plan(view)) == [("close", "b")]


def test_busy_victim_is_closed_then_retired_once_idle() -> None:
    head = waiter(1, "b", since=NOW - 2)
    view = pool(engine("a", in_flight=2), waiters=(head,), max_loaded=1)
    assert summary(plan(view)) == [("close", "a")]  # closed, not retired: requests in flight

    # While it drains it takes nothing new: a request for it queues behind b.
    late = waiter(2, "a", since=NOW - 1)
    closing = engine("a", in_flight=2, closing=True)
    assert plan(pool(closing, waiters=(head, late), max_loaded=1)) == []
    closing = replace(closing, in_flight=0)
    assert summary(plan(pool(closing, waiters=(head, late), max_loaded=1))) == [("retire", "a")]
    gone = engine("a", state="stopped")
    assert summary(plan(pool(gone, waiters=(head, late), max_loaded=1))) == [("start", "b")]


@pytest.mark.parametrize("guard", [{"pinned": True}, {"leased": True}])
@pytest.mark.parametrize("in_flight", [0, 2])
def test_pinned_and_leased_engines_are_never_evicted(
    guard: dict[str, bool], in_flight: int
) -> None:
    kept = engine("kept", last_used=1, in_flight=in_flight, **guard)
    other = engine("other", last_used=9)
    view = pool(kept, other, waiters=(waiter(1, "x"),), max_loaded=2)
    assert summary(plan(view)) == [("close", "other"), ("retire", "other")]

    # With nothing else to evict, the waiter waits, then times out.
    alone = pool(kept, waiters=(waiter(1, "x", since=NOW),), max_loaded=1)
    assert plan(alone) == []
    assert plan(replace(alone, now=NOW + 299)) == []
    assert summary(plan(replace(alone, now=NOW + 300))) == [("reject:queue_timeout", 1)]


def test_no_eviction_when_the_model_could_not_fit_anyway() -> None:
    # Closing `idle` would not make room while `pinned` holds the rest: keep it.
    engines = (engine("pinned", gib=8, pinned=True), engine("idle", gib=4))
    view = pool(*engines, waiters=(waiter(1, "x", gib=10),), budget_gib=16)
    assert plan(view) == []


def test_room_being_freed_is_waited_for_not_freed_twice() -> None:
    engines = (engine("a", in_flight=1, closing=True, last_used=1), engine("b", last_used=9))
    view = pool(*engines, waiters=(waiter(1, "x"),), max_loaded=2)
    assert plan(view) == []


@pytest.mark.parametrize("state", ["draining", "stopping"])
def test_an_engine_already_stopping_counts_as_room_being_freed(state: str) -> None:
    engines = (engine("a", state=state, last_used=1), engine("b", last_used=9))
    assert plan(pool(*engines, waiters=(waiter(1, "x"),), max_loaded=2)) == []


def test_a_waiter_admitted_now_makes_its_engine_busy() -> None:
    # `a` is idle in the view but gets request 2 in this plan: it must not be retired with it.
    engines = (engine("a", last_used=1), engine("b", last_used=9))
    view = pool(*engines, waiters=(waiter(1, "x", since=NOW - 1), waiter(2, "a")), max_loaded=2)
    assert summary(plan(view)) == [("admit", 2), ("close", "b"), ("retire", "b")]


def test_a_waiter_admitted_now_makes_its_engine_the_most_recently_used() -> None:
    engines = (engine("a", last_used=1, in_flight=1), engine("b", last_used=9, in_flight=1))
    view = pool(*engines, waiters=(waiter(1, "x", since=NOW - 1), waiter(2, "a")), max_loaded=2)
    assert summary(plan(view)) == [("admit", 2), ("close", "b")]


# Head of line


def test_a_later_model_does_not_take_the_room_freed_for_the_head() -> None:
    waiting = (waiter(1, "big", since=NOW - 1, gib=12), waiter(2, "small", gib=4))
    view = pool(engine("a", gib=8, in_flight=1), waiters=waiting, budget_gib=16)
    assert summary(plan(view)) == [("close", "a")]  # small would fit beside a: it waits
    closing = engine("a", gib=8, in_flight=1, closing=True)
    assert plan(pool(closing, waiters=waiting, budget_gib=16)) == []


def test_a_head_that_cannot_get_room_holds_the_line_until_it_times_out() -> None:
    pinned = engine("p", gib=8, pinned=True)
    waiting = (waiter(1, "big", since=0, gib=12), waiter(2, "small", since=100, gib=4))
    assert plan(pool(pinned, waiters=waiting, now=299)) == []
    assert summary(plan(pool(pinned, waiters=waiting, now=300))) == [
        ("reject:queue_timeout", 1),
        ("start", "small"),
    ]


def test_a_head_whose_engine_is_starting_lets_later_models_start() -> None:
    view = pool(engine("a", state="starting"), waiters=(waiter(1, "a"), waiter(2, "b")))
    assert summary(plan(view)) == [("start", "b")]


# Rejection and the bounded queue


@pytest.mark.parametrize(
    ("need_gib", "max_loaded", "rejected"),
    [(17, None, True), (16, None, False), (1, 0, True), (1, 1, False)],
)
def test_never_fits(need_gib: int, max_loaded: int | None, rejected: bool) -> None:
    limits = Limits(16 * GIB, max_loaded)
    assert never_fits(need_gib * GIB, limits) is rejected
    view = pool(waiters=(waiter(1, "a", gib=need_gib),), max_loaded=max_loaded)
    assert (("reject:too_big", 1) in summary(plan(view))) is rejected


def test_a_request_too_big_is_rejected_at_once_and_blocks_nobody() -> None:
    view = pool(waiters=(waiter(1, "huge", gib=17), waiter(2, "a")))
    assert summary(plan(view)) == [("reject:too_big", 1), ("start", "a")]


@pytest.mark.parametrize(
    ("waited_s", "rejected"), [(0, False), (299.9, False), (300, True), (1e6, True)]
)
def test_queue_timeout(waited_s: float, rejected: bool) -> None:
    view = pool(engine("a", state="starting"), waiters=(waiter(1, "a", since=NOW - waited_s),))
    assert summary(plan(view)) == ([("reject:queue_timeout", 1)] if rejected else [])


def test_a_timed_out_waiter_is_rejected_even_if_it_could_run_now() -> None:
    view = pool(engine("a"), waiters=(waiter(1, "a", since=NOW - 300),))
    assert summary(plan(view)) == [("reject:queue_timeout", 1)]


@pytest.mark.parametrize(
    ("num_queued", "max_queue", "ok"),
    [(0, 0, False), (0, 1, True), (255, 256, True), (256, 256, False)],
)
def test_can_queue(num_queued: int, max_queue: int, ok: bool) -> None:
    assert can_queue(num_queued, Limits(GIB, max_queue=max_queue)) is ok


# Idle TTL


@pytest.mark.parametrize(
    ("ttl_s", "idle_s", "expires"),
    [(-1, 1e9, False), (0, 0, True), (30, 29.9, False), (30, 30, True), (30, 31, True)],
)
def test_idle_ttl(ttl_s: float, idle_s: float, expires: bool) -> None:
    view = pool(engine("a", idle_ttl_s=ttl_s, last_used=NOW - idle_s))
    assert summary(plan(view)) == ([("close", "a"), ("retire", "a")] if expires else [])


@pytest.mark.parametrize(
    "kw",
    [{"pinned": True}, {"leased": True}, {"in_flight": 1}, {"state": "starting"}],
    ids=["pinned", "leased", "busy", "starting"],
)
def test_these_never_expire(kw: dict[str, Any]) -> None:
    view = pool(engine("a", idle_ttl_s=0, last_used=0, **kw))
    assert plan(view) == []


def test_an_engine_closes_once_when_both_expired_and_evicted() -> None:
    assert summary(plan(pool(engine("a", idle_ttl_s=0, closing=True)))) == [("retire", "a")]
    expired = engine("a", idle_ttl_s=0, last_used=0)
    view = pool(expired, waiters=(waiter(1, "b"),), max_loaded=1)
    assert summary(plan(view)) == [("close", "a"), ("retire", "a")]


def test_an_engine_with_a_request_waiting_does_not_expire() -> None:
    view = pool(engine("a", idle_ttl_s=0, last_used=0), waiters=(waiter(1, "a"),))
    assert summary(plan(view)) == [("admit", 1)]


def test_a_leased_engine_with_others_queued_does_not_expire() -> None:
    view = pool(engine("a", idle_ttl_s=0, last_used=0, leased=True), waiters=(waiter(1, "a"),))
    assert plan(view) == []


# next_deadline


def test_no_deadline_when_nothing_is_due() -> None:
    view = pool(
        engine("never", idle_ttl_s=-1),
        engine("pinned", idle_ttl_s=0, pinned=True),
        engine("leased", idle_ttl_s=5, leased=True),
        engine("busy", idle_ttl_s=5, in_flight=1),
        engine("starting", state="starting", idle_ttl_s=5),
        engine("stopped", state="stopped", idle_ttl_s=5),
    )
    assert next_deadline(view) is None


@pytest.mark.parametrize(
    ("queue_timeout_s", "deadline"),
    [(300.0, 950.0), (20.0, 930.0)],
    ids=["ttl first", "waiter first"],
)
def test_next_deadline_is_the_earliest_due(queue_timeout_s: float, deadline: float) -> None:
    view = pool(
        engine("a", idle_ttl_s=100, last_used=850),
        engine("b", idle_ttl_s=100, last_used=900),
        engine("c", state="starting"),
        waiters=(waiter(1, "c", since=910), waiter(2, "c", since=920)),
        queue_timeout_s=queue_timeout_s,
        now=925,
    )
    assert next_deadline(view) == deadline
    # plan acts at the deadline and not before.
    assert plan(replace(view, now=deadline - 0.001)) == []
    assert plan(replace(view, now=deadline)) != []


# Machine lease


def test_machine_lease_closes_every_engine_and_starts_none() -> None:
    view = pool(
        engine("idle"),
        engine("busy", in_flight=1),
        engine("leased", leased=True),
        engine("pinned", pinned=True),
        engine("starting", state="starting"),
        engine("stopped", state="stopped"),
        waiters=(waiter(1, "idle"), waiter(2, "new"), waiter(3, "leased", holds_lease=True)),
        budget_gib=64,
        machine_leased=True,
    )
    actions = plan(view)
    assert of_kind(actions, Close) == {"idle", "busy", "leased", "pinned", "starting"}
    assert of_kind(actions, Retire) == {"idle", "pinned", "starting"}
    assert not of_kind(actions, Start) and not of_kind(actions, Admit)


def test_machine_lease_retires_a_leased_engine_once_its_lease_ends() -> None:
    leased = engine("a", leased=True, closing=True)
    assert plan(pool(leased, machine_leased=True)) == []
    ended = replace(leased, leased=False)
    assert summary(plan(pool(ended, machine_leased=True))) == [("retire", "a")]


def test_machine_lease_still_times_waiters_out() -> None:
    view = pool(waiters=(waiter(1, "a", since=NOW - 300),), machine_leased=True)
    assert summary(plan(view)) == [("reject:queue_timeout", 1)]


# A toy pool that carries out the plan, to check sequences


@dataclass
class Sim:
    """Applies plan's actions to a view, one step at a time, asserting what a pool relies on.

    Start gives a "starting" engine that is "ready" on the next step; Retire stops it at once;
    Admit puts the request in flight for `service_steps` steps.
    """

    sizes: dict[str, int]
    limits: Limits
    ttl_s: float = -1.0
    service_steps: int = 2
    now: float = 0.0
    engines: dict[str, EngineView] = field(default_factory=dict)
    waiters: list[WaiterView] = field(default_factory=list)
    running: list[tuple[str, int]] = field(default_factory=list)
    starts: list[str] = field(default_factory=list)
    served: list[str] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)
    num_arrived: int = 0

    def arrive(self, *models: str) -> None:
        for model in models:
            self.num_arrived += 1
            self.waiters.append(WaiterView(self.num_arrived, model, self.now, self.sizes[model]))

    def step(self) -> list[Action]:
        self.now += 1
        for model, e in self.engines.items():
            if e.state == "starting":
                self.engines[model] = replace(e, state="ready")
        self._finish_requests()
        view = PoolView(dict(self.engines), list(self.waiters), self.limits, self.now)
        actions = plan(view)
        for action in actions:
            self._apply(action)
        self._check_room()
        return actions

    def run(self, max_steps: int = 500) -> None:
        """Step until nothing waits or runs."""
        for _ in range(max_steps):
            if not self.waiters and not self.running:
                return
            self.step()
        raise AssertionError(f"stuck: {self.waiters} {self.engines}")

    def _finish_requests(self) -> None:
        still = []
        for model, steps_left in self.running:
            if steps_left > 1:
                still.append((model, steps_left - 1))
                continue
            e = self.engines[model]
            self.engines[model] = replace(e, in_flight=e.in_flight - 1, last_used=self.now)
        self.running = still

    def _apply(self, action: Action) -> None:
        match action:
            case Admit(waiter=id):
                w = self._take_waiter(id)
                e = self.engines[w.model]
                assert e.state == "ready" and not e.closing, (action, e)
                assert not e.leased or w.holds_lease, (action, e)
                self.engines[w.model] = replace(e, in_flight=e.in_flight + 1, last_used=self.now)
                self.running.append((w.model, self.service_steps))
                self.served.append(w.model)
            case Reject(waiter=id, reason=reason):
                self.rejected[self._take_waiter(id).id] = reason
            case Start(model=m):
                assert m not in self.engines or self.engines[m].state not in LIVE, action
                self.engines[m] = EngineView(
                    m, "starting", self.sizes[m], last_used=self.now, idle_ttl_s=self.ttl_s
                )
                self.starts.append(m)
            case Close(model=m):
                assert self.engines[m].state in LIVE, action
                self.engines[m] = replace(self.engines[m], closing=True)
            case Retire(model=m):
                e = self.engines[m]
                assert e.state in LIVE and e.in_flight == 0 and not e.leased, (action, e)
                self.engines[m] = replace(e, state="stopped", closing=False)

    def _take_waiter(self, id: int) -> WaiterView:
        (w,) = [w for w in self.waiters if w.id == id]
        self.waiters.remove(w)
        return w

    def _check_room(self) -> None:
        live = [e for e in self.engines.values() if e.state in LIVE]
        assert sum(e.memory_bytes for e in live) <= self.limits.budget_bytes, live
        max_loaded = self.limits.max_loaded
        assert max_loaded is None or len(live) <= max_loaded, live


def runs(models: list[str]) -> list[str]:
    """The sequence with repeats collapsed: a a b a -> a b a."""
    return [m for i, m in enumerate(models) if i == 0 or models[i - 1] != m]


def test_interleaved_requests_queued_together_are_served_in_one_batch_per_model() -> None:
    sim = Sim({"a": 6 * GIB, "b": 6 * GIB}, Limits(8 * GIB))
    sim.arrive(*["a", "b"] * 4)
    sim.run()
    assert sim.starts == ["a", "b"]  # one swap, not one per request
    assert runs(sim.served) == ["a", "b"] and len(sim.served) == 8


def test_interleaved_waves_swap_once_per_change_of_model() -> None:
    sim = Sim({"a": 4 * GIB, "b": 4 * GIB}, Limits(16 * GIB, max_loaded=1))
    for wave in ("a", "b", "a", "b"):
        sim.arrive(wave, wave, wave)
        sim.step()
    sim.run()
    # The second wave of b arrives while b waits, so it joins b's batch.
    assert sim.starts == ["a", "b", "a"]
    assert runs(sim.served) == sim.starts
    assert sorted(sim.served) == ["a"] * 6 + ["b"] * 6


def test_a_steady_alternating_stream_swaps_per_batch_not_per_request() -> None:
    sim = Sim({"a": 4 * GIB, "b": 4 * GIB}, Limits(16 * GIB, max_loaded=1), service_steps=3)
    for i in range(40):
        sim.arrive("ab"[i % 2])
        sim.step()
    sim.run()
    assert len(sim.served) == 40 and not sim.rejected
    assert runs(sim.served) == sim.starts  # every start serves one batch
    assert len(sim.starts) <= 40 // 4


def test_swap_waits_for_the_busy_victim_to_drain() -> None:
    sim = Sim({"a": 4 * GIB, "b": 4 * GIB}, Limits(16 * GIB, max_loaded=1), service_steps=4)
    sim.arrive("a")
    assert summary(sim.step()) == [("start", "a")]
    assert summary(sim.step()) == [("admit", 1)]
    sim.arrive("b")
    assert summary(sim.step()) == [("close", "a")]
    sim.arrive("a")  # a is closing: this one waits for the next turn of a
    for _ in range(2):
        assert sim.step() == []
    assert summary(sim.step()) == [("retire", "a")]
    assert summary(sim.step()) == [("start", "b")]
    sim.run()
    assert sim.starts == ["a", "b", "a"] and sim.served == ["a", "b", "a"]


def test_idle_ttl_zero_stops_the_engine_after_its_last_request() -> None:
    sim = Sim({"a": 4 * GIB}, Limits(16 * GIB), ttl_s=0, service_steps=1)
    sim.arrive("a")
    assert summary(sim.step()) == [("start", "a")]
    assert summary(sim.step()) == [("admit", 1)]  # ready and idle, but not retired with it
    assert summary(sim.step()) == [("close", "a"), ("retire", "a")]  # its request is done
    sim.arrive("a")
    sim.run()
    assert sim.starts == ["a", "a"]


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 10), min_size=1, max_size=4),
    budget=st.integers(6, 16),
    max_loaded=st.sampled_from([None, 1, 2, 3]),
    ttl_s=st.sampled_from([-1.0, 0.0, 1.0, 3.0]),
    service_steps=st.integers(1, 4),
    arrivals=st.lists(st.lists(st.integers(0, 3), max_size=4), max_size=20),
)
def test_any_arrival_pattern_keeps_the_invariants_and_serves_everyone(
    sizes: list[int],
    budget: int,
    max_loaded: int | None,
    ttl_s: float,
    service_steps: int,
    arrivals: list[list[int]],
) -> None:
    models = {f"m{i}": gib * GIB for i, gib in enumerate(sizes)}
    names = list(models)
    limits = Limits(budget * GIB, max_loaded, queue_timeout_s=1e9)
    sim = Sim(models, limits, ttl_s=ttl_s, service_steps=service_steps)
    for batch in arrivals:
        sim.arrive(*(names[i % len(names)] for i in batch))
        sim.step()
    sim.run()
    arrived = [names[i % len(names)] for batch in arrivals for i in batch]
    fits = [m for m in arrived if models[m] <= limits.budget_bytes]
    assert sorted(sim.served) == sorted(fits)
    assert list(sim.rejected.values()) == ["too_big"] * (len(arrived) - len(fits))
    assert len(sim.starts) <= len(sim.served)


# Crash loops


CRASH = CrashLimits(limit=3, window_s=60.0, cooldown_s=15.0, cooldown_max_s=300.0, healthy_reset_s=600.0)


def crash_at(*times: float, history: CrashHistory | None = None, **kw: Any) -> tuple[CrashHistory, float | None]:
    history, cooldown = history or CrashHistory(), None
    for t in times:
        history, cooldown = after_crash(history, t, CRASH, **kw)
    return history, cooldown


def test_crashes_below_the_limit_restart() -> None:
    history, cooldown = crash_at(0.0, 10.0)
    assert cooldown is None and history == CrashHistory((0.0, 10.0), 0)


def test_the_limit_within_the_window_fails_the_model_for_the_first_cool_down() -> None:
    history, cooldown = crash_at(0.0, 10.0, 20.0)
    assert cooldown == 15.0
    assert history == CrashHistory((), 1)  # the retry gets the whole limit again


def test_crashes_older_than_the_window_do_not_count() -> None:
    assert crash_at(0.0, 10.0, 70.5)[1] is None
    assert crash_at(0.0, 10.0, 60.0)[1] is None  # one window_s ago: out
    assert crash_at(0.0, 59.0, 59.9)[1] == 15.0


def test_a_start_that_cannot_succeed_fails_at_once_but_is_tried_again_later() -> None:
    assert crash_at(0.0, can_retry=False) == (CrashHistory((), 1), 15.0)


@pytest.mark.parametrize(("num_failures", "cooldown"), [(1, 15.0), (2, 30.0), (3, 60.0), (5, 240.0), (6, 300.0), (40, 300.0)])
def test_the_cool_down_doubles_with_each_failure_up_to_the_cap(num_failures: int, cooldown: float) -> None:
    assert cooldown_s(num_failures, CRASH) == cooldown


def test_a_failure_after_the_retry_doubles_the_cool_down() -> None:
    history, first = crash_at(0.0, 1.0, 2.0)
    history, second = crash_at(20.0, 21.0, 22.0, history=history)
    history, third = crash_at(60.0, can_retry=False, history=history)
    assert (first, second, third) == (15.0, 30.0, 60.0)


@pytest.mark.parametrize(("served_s", "forgets"), [(0.0, False), (599.0, False), (600.0, True), (5000.0, True)])
def test_a_healthy_spell_forgets_failures_and_crashes(served_s: float, forgets: bool) -> None:
    history = CrashHistory((5.0,), 3)
    after = forget_if_healthy(history, served_s, CRASH)
    assert after == (CrashHistory() if forgets else history)
    assert crash_at(1000.0, 1001.0, 1002.0, history=after)[1] == (15.0 if forgets else 120.0)


@pytest.mark.parametrize(("crashes", "delay"), [((), 0.0), ((50.0,), 1.0), ((40.0, 50.0), 2.0), ((0.0, 50.0), 1.0),
                                               (tuple(range(50, 60)), 60.0)])
def test_restart_back_off_counts_crashes_in_the_window(crashes: tuple[float, ...], delay: float) -> None:
    assert restart_delay_s(CrashHistory(crashes), 61.0, CRASH, base_s=1.0) == delay


@pytest.mark.parametrize(("seconds", "header"), [(0.0, 1), (0.2, 1), (1.0, 1), (1.01, 2), (14.5, 15), (300.0, 300)])
def test_retry_after_is_whole_seconds_rounded_up(seconds: float, header: int) -> None:
    assert retry_after_s(seconds) == header


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.floats(0.0, 200.0), min_size=1, max_size=40), no_retry=st.lists(st.booleans(), max_size=40))
def test_crash_loop_rules_hold_for_any_crash_pattern(gaps: list[float], no_retry: list[bool]) -> None:
    """Failed exactly when `limit` crashes fall in the window (or a start can't succeed); cool-downs
    never shrink between healthy spells and stay within [cooldown_s, cooldown_max_s]."""
    history, now, last_cooldown = CrashHistory(), 0.0, 0.0
    for i, gap in enumerate(gaps):
        now += gap
        can_retry = not (no_retry[i] if i < len(no_retry) else False)
        recent = [t for t in history.crashes if now - t < CRASH.window_s]
        history, cooldown = after_crash(history, now, CRASH, can_retry)
        assert (cooldown is not None) == (not can_retry or len(recent) + 1 >= CRASH.limit)
        if cooldown is not None:
            assert CRASH.cooldown_s <= cooldown <= CRASH.cooldown_max_s and cooldown >= last_cooldown
            assert history.crashes == ()
            last_cooldown = cooldown
        assert len(history.crashes) < CRASH.limit


@pytest.mark.parametrize(("num_young_deaths", "delay"), [(0, 1.0), (1, 2.0), (2, 4.0), (5, 32.0), (6, 60.0), (50, 60.0)])
def test_a_spare_that_keeps_dying_young_is_made_again_later_each_time(num_young_deaths: int, delay: float) -> None:
    assert spare_delay_s(num_young_deaths, quiet_s=1.0) == delay
