"""The pool's policy: which requests run, which engines start, which are stopped.

Pure code: `plan(view)` maps a snapshot of the pool (engines, the queue of waiting requests,
limits, leases, the time) to a list of actions, and `Pool` carries them out. No processes,
sockets or clocks here, so every rule is unit-tested directly (tests/unit/test_policy.py).

The rules, in the order `plan` applies them:
1. A waiter past its timeout (`queue_timeout_s` unless it has its own) is rejected (503).
2. A waiter whose model's engine is READY, not closing and not leased to someone else runs.
3. Models with waiters left start, most urgent waiter first (the lowest `priority`, then the
   oldest), while memory and `max_loaded` allow.
   When the head model does not fit, least-recently-used idle engines are chosen to make
   room, then busy ones (they are closed: they take nothing new and stop once idle). Pinned
   and leased engines are never chosen. Nothing behind the head model starts until it has:
   memory freed for it is not taken by a later arrival.
4. A closing engine with nothing in flight is retired (drained, then stopped).
5. An idle engine past its TTL is retired (-1: never; 0: right after its last request).
A whole-machine lease closes every engine and starts none.

No thrash: a closed engine admits nothing new, so requests for it that arrive during a swap
queue behind the model being swapped in, and each swap serves a batch, not one request.

Crash loops (when a model is failed, and for how long) and the spare engine's back-off are
decided here too, at the end of this file.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from mlxd.protocol.engine_state import ACCEPTING, LEAVING, LIVE, EngineState


@dataclass(frozen=True, slots=True)
class EngineView:
    """One model's engine as the policy sees it."""

    model: str
    state: EngineState  # a StrEnum: a test may write "ready"
    memory_bytes: int
    in_flight: int = 0
    last_used: float = 0.0
    pinned: bool = False
    leased: bool = False
    closing: bool = False
    idle_ttl_s: float = -1.0


@dataclass(frozen=True, slots=True)
class WaiterView:
    """A queued request, admin load or lease for a model: each waits for its engine to be READY."""

    id: int
    model: str
    since: float
    memory_bytes: int
    holds_lease: bool = False  # carries the model's lease id: passes the lease
    timeout_s: float | None = None  # None: the queue's; admin loads and leases wait longer
    priority: int = 0  # the request's (or its key's): lower starts its model sooner

    def deadline(self, limits: Limits) -> float:
        return self.since + (self.timeout_s if self.timeout_s is not None else limits.queue_timeout_s)


@dataclass(frozen=True, slots=True)
class Limits:
    budget_bytes: int
    max_loaded: int | None = None
    max_queue: int = 256
    queue_timeout_s: float = 300.0


@dataclass(frozen=True, slots=True)
class PoolView:
    engines: dict[str, EngineView]
    waiters: list[WaiterView]  # oldest first
    limits: Limits
    now: float
    machine_leased: bool = False


@dataclass(frozen=True, slots=True)
class Admit:
    waiter: int


@dataclass(frozen=True, slots=True)
class Reject:
    waiter: int
    reason: str  # "queue_timeout" | "too_big"


@dataclass(frozen=True, slots=True)
class Start:
    model: str


@dataclass(frozen=True, slots=True)
class Close:
    """Admit nothing new to this engine; it is retired once idle."""

    model: str
    reason: str


@dataclass(frozen=True, slots=True)
class Retire:
    """Drain, then stop, this (idle) engine."""

    model: str
    reason: str


Action = Admit | Reject | Start | Close | Retire


@dataclass(slots=True)
class _Room:
    """Memory and engine slots in use, as actions are planned."""

    used_bytes: int
    num_live: int
    limits: Limits

    def fits(self, need_bytes: int) -> bool:
        slots_ok = self.limits.max_loaded is None or self.num_live + 1 <= self.limits.max_loaded
        return slots_ok and self.used_bytes + need_bytes <= self.limits.budget_bytes

    def take(self, need_bytes: int) -> None:
        self.used_bytes += need_bytes
        self.num_live += 1


@dataclass(slots=True)
class _Plan:
    actions: list[Action] = field(default_factory=list)
    closing: set[str] = field(default_factory=set)


def can_queue(num_queued: int, limits: Limits) -> bool:
    """Whether one more waiter fits the bounded queue."""
    return num_queued < limits.max_queue


def never_fits(memory_bytes: int, limits: Limits) -> bool:
    """A model bigger than the whole budget: an immediate 400, not a wait."""
    return memory_bytes > limits.budget_bytes or limits.max_loaded == 0


def plan(view: PoolView) -> list[Action]:
    """Every action the pool should take now, in order."""
    out = _Plan(closing={m for m, e in view.engines.items() if e.closing})
    waiters = _expire(view, out)
    if view.machine_leased:
        _close_all(view, out)
    else:
        left = _admit(view, waiters, out)
        left_ids = {w.id for w in left}
        view = _with_admitted(view, [w for w in waiters if w.id not in left_ids])
        waiters = left
        _start(view, waiters, out)
        _expire_idle(view, waiters, out)
    _retire_closing(view, out)
    return out.actions


def next_deadline(view: PoolView) -> float | None:
    """When `plan` may next act with nothing else happening: a queue timeout or an idle TTL."""
    times = [w.deadline(view.limits) for w in view.waiters]
    times += [e.last_used + e.idle_ttl_s for e in view.engines.values() if may_expire(e)]
    return min(times, default=None)


def _expire(view: PoolView, out: _Plan) -> list[WaiterView]:
    kept = []
    for w in view.waiters:
        if never_fits(w.memory_bytes, view.limits):
            out.actions.append(Reject(w.id, "too_big"))
        elif view.now >= w.deadline(view.limits):
            out.actions.append(Reject(w.id, "queue_timeout"))
        else:
            kept.append(w)
    return kept


def _close_all(view: PoolView, out: _Plan) -> None:
    for e in view.engines.values():
        if e.state in LIVE and e.model not in out.closing:
            out.closing.add(e.model)
            out.actions.append(Close(e.model, "machine_lease"))


def _admit(view: PoolView, waiters: list[WaiterView], out: _Plan) -> list[WaiterView]:
    left = []
    for w in waiters:
        e = view.engines.get(w.model)
        runnable = e is not None and e.state == EngineState.READY and e.model not in out.closing
        if runnable and e is not None and (not e.leased or w.holds_lease):
            out.actions.append(Admit(w.id))
        else:
            left.append(w)
    return left


def _with_admitted(view: PoolView, admitted: list[WaiterView]) -> PoolView:
    """The view once `admitted` run: their engines are busy and just used, so not evicted
    idle, expired or retired in the same plan (test_a_waiter_admitted_now_makes_its_engine_busy)."""
    engines = dict(view.engines)
    for w in admitted:
        e = engines[w.model]
        engines[w.model] = replace(e, in_flight=e.in_flight + 1, last_used=view.now)
    return replace(view, engines=engines)


def _start(view: PoolView, waiters: list[WaiterView], out: _Plan) -> None:
    live = [e for e in view.engines.values() if e.state in LIVE]
    room = _Room(sum(e.memory_bytes for e in live), len(live), view.limits)
    for model, need in _wanted(sorted(waiters, key=lambda w: (w.priority, w.since))):
        engine = view.engines.get(model)
        if engine is not None and engine.state in LIVE:
            continue  # starting, or stopping before it starts again: wait for it
        if room.fits(need):
            room.take(need)
            out.actions.append(Start(model))
            continue
        _make_room(view, waiters, model, need, out)
        return  # head of line: nothing behind this model starts before it does


def _wanted(waiters: Iterable[WaiterView]) -> list[tuple[str, int]]:
    """Models with waiters, in the order of their first waiter in `waiters`, with their memory needs."""
    seen: dict[str, int] = {}
    for w in waiters:
        seen.setdefault(w.model, w.memory_bytes)
    return list(seen.items())


def _make_room(view: PoolView, waiters: list[WaiterView], model: str, need: int, out: _Plan) -> None:
    """Close the fewest least-recently-used engines that let `model` start; none if that can't work."""
    live = [e for e in view.engines.values() if e.state in LIVE]
    freeing = [e for e in live if e.model in out.closing or e.state in LEAVING]
    used = sum(e.memory_bytes for e in live) - sum(e.memory_bytes for e in freeing)
    num_live = len(live) - len(freeing)
    room = _Room(used, num_live, view.limits)
    if room.fits(need):
        return  # what is already being freed is enough: wait for it
    queued_for = {w.model for w in waiters}
    candidates = sorted(
        (e for e in live if e not in freeing and _can_evict(e, queued_for)),
        key=lambda e: (e.in_flight > 0, e.last_used),
    )
    chosen = []
    for e in candidates:
        if room.fits(need):
            break
        chosen.append(e)
        room.used_bytes -= e.memory_bytes
        room.num_live -= 1
    if not room.fits(need):
        return  # pinned or leased engines hold the room: the waiters wait (and may time out)
    for e in chosen:
        out.closing.add(e.model)
        out.actions.append(Close(e.model, f"making room for {model}"))


def _can_evict(e: EngineView, queued_for: set[str]) -> bool:
    return e.state == EngineState.READY and not e.pinned and not e.leased and e.model not in queued_for


def may_expire(e: EngineView) -> bool:
    return e.state == EngineState.READY and e.idle_ttl_s >= 0 and e.in_flight == 0 and not e.pinned and not e.leased


def _expire_idle(view: PoolView, waiters: list[WaiterView], out: _Plan) -> None:
    queued_for = {w.model for w in waiters}
    for e in view.engines.values():
        expired = may_expire(e) and view.now - e.last_used >= e.idle_ttl_s
        if expired and e.model not in out.closing and e.model not in queued_for:
            out.closing.add(e.model)
            out.actions.append(Close(e.model, "idle"))


def _retire_closing(view: PoolView, out: _Plan) -> None:
    for model in sorted(out.closing):
        e = view.engines.get(model)
        if e is not None and e.in_flight == 0 and not e.leased and e.state in ACCEPTING:
            out.actions.append(Retire(model, "closing"))


# --- crash loops -------------------------------------------------------------------------
# Like systemd's restart limits: a model whose engine crashes (or fails to start) `limit` times
# within `window_s` is failed, answers 503 with Retry-After, and is tried again by itself after
# a cool-down. The cool-down doubles with each failure, up to `cooldown_max_s`, until the model
# has served a healthy spell. The engine's owner task keeps the history and asks these.

MAX_BACKOFF_S = 60.0  # the restart delay's cap, within a window of crashes


@dataclass(frozen=True, slots=True)
class CrashLimits:
    """The `[pool]` crash-loop keys."""

    limit: int = 5
    window_s: float = 60.0
    cooldown_s: float = 15.0
    cooldown_max_s: float = 300.0
    healthy_reset_s: float = 600.0


@dataclass(frozen=True, slots=True)
class CrashHistory:
    """One model's crashes, as the crash-loop rules see them."""

    crashes: tuple[float, ...] = ()  # when it crashed or failed to start, since its last failure
    num_failures: int = 0  # times it was failed since it last served a healthy spell


def after_crash(
    history: CrashHistory, now: float, limits: CrashLimits, can_retry: bool = True,
) -> tuple[CrashHistory, float | None]:
    """The history after a crash at `now`, and the cool-down if the model is now failed (None: restart).

    `can_retry` False (an exit code that says a restart won't help, e.g. a bad model dir) fails it
    at once: a cool-down still, since the user may fix the model dir meanwhile.
    """
    crashes = (*(t for t in history.crashes if now - t < limits.window_s), now)
    if can_retry and len(crashes) < limits.limit:
        return CrashHistory(crashes, history.num_failures), None
    failures = history.num_failures + 1
    return CrashHistory((), failures), cooldown_s(failures, limits)  # the retry gets the full limit again


def cooldown_s(num_failures: int, limits: CrashLimits) -> float:
    """The cool-down after the `num_failures`-th failure in a row: `cooldown_s`, doubling, capped."""
    return min(limits.cooldown_max_s, limits.cooldown_s * 2.0 ** max(0, num_failures - 1))


def forget_if_healthy(history: CrashHistory, served_s: float, limits: CrashLimits) -> CrashHistory:
    """An engine that served `served_s` without crashing: a healthy spell forgets the past."""
    return CrashHistory() if served_s >= limits.healthy_reset_s else history


def restart_delay_s(history: CrashHistory, now: float, limits: CrashLimits, base_s: float = 1.0) -> float:
    """The back-off before a start: 0 after no recent crash, then `base_s` doubling per crash, to 60 s."""
    num_recent = sum(1 for t in history.crashes if now - t < limits.window_s)
    return 0.0 if num_recent == 0 else min(MAX_BACKOFF_S, base_s * 2.0 ** (num_recent - 1))


def retry_after_s(seconds: float) -> int:
    """A Retry-After header's whole seconds: rounded up, at least 1."""
    return max(1, math.ceil(seconds))


def spare_delay_s(num_young_deaths: int, quiet_s: float, max_s: float = 60.0) -> float:
    """How long the pool stays quiet before making a spare: `quiet_s`, doubled for each spare in
    a row that died young (one that dies at once must not respawn in a tight loop), capped."""
    return min(max_s, quiet_s * 2.0 ** num_young_deaths)
