"""The GPU thread's scheduler: the queue of waiting jobs, and each turn what becomes of them.

Pure code (no MLX, no threads): the Runner asks `plan` once a turn, with what the lanes hold,
and carries out the decisions. Jobs are taken in order: by `priority` (lower first), then
as they came (FIFO). The first one that does not fit (the width is full, or its KV does not
fit what is free) holds the rest back, so a long job is never overtaken for ever by short
ones of its priority (more urgent ones do overtake it). A cancelled job at the head is dropped; one
that does not fit even with nothing running is refused (submit refuses those first, so that
is a bug's safety net). scheduling.py decides the lane and holds the KV ledger.

When the head does not fit and less urgent jobs are running, the least urgent of them are
paused, as few as make room (the last started first among equals): each goes back to the
queue at the front of its priority, its KV kept in the prompt cache by its lane, and starts
again where it stopped once there is room. Only a strictly more urgent job pauses another,
so jobs of one priority never take turns pausing each other.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from mlxd.engine.gpu.scheduling import KvLedger, LaneName, LaneState, choose_lane, kv_tokens
from mlxd.protocol.errors import APIError


class Waiting(Protocol):
    """What the scheduler reads of a job (a Sequence; a plain stand-in in the unit tests)."""

    @property
    def kv_need(self) -> int: ...

    @property
    def is_cancelled(self) -> bool: ...

    @property
    def group_size(self) -> int: ...

    @property
    def priority(self) -> int: ...


W = TypeVar("W", bound=Waiting)


@dataclass(frozen=True, slots=True)
class LaneLoad(Generic[W]):
    """What the lanes hold as a turn begins, and the running jobs that could be paused."""

    serial_busy: bool
    batch_rows: int
    pausable: tuple[tuple[W, LaneName], ...] = ()
    running_priority: int | None = None  # the most urgent running job's priority (None: none runs)


@dataclass(frozen=True, slots=True)
class Start(Generic[W]):
    """Start the job in this lane (its KV is booked)."""

    job: W
    lane: LaneName


@dataclass(frozen=True, slots=True)
class Drop(Generic[W]):
    """The job was cancelled (or the engine stops) before it started: answer it as cancelled."""

    job: W


@dataclass(frozen=True, slots=True)
class Refuse(Generic[W]):
    """The job can never start here: answer it with this error."""

    job: W
    message: str


@dataclass(frozen=True, slots=True)
class Pause(Generic[W]):
    """Take this running job out of its lane, its KV to the prompt cache: it waits again (its
    KV booking is already released)."""

    job: W
    lane: LaneName


Decision = Start[W] | Drop[W] | Refuse[W] | Pause[W]


class Scheduler(Generic[W]):
    """The waiting jobs, in order, and the KV booked by running ones (GPU thread; the budget
    and `num_waiting` may be read from the loop thread)."""

    def __init__(self, width: int, kv_budget_tokens: int, short_budget_hint: str = "") -> None:
        self.width = width  # --batch: sequences at once, in both lanes
        self.kv = KvLedger(kv_budget_tokens)
        # What a refusal says to change (protocol.sizing.short_memory_hint); "" : the generic advice.
        self.short_budget_hint = short_budget_hint or (
            "raise the budget with `max_context` (up to the model's window) or `batch` in the model's "
            "[models.NAME] entry of mlxd's config")
        self._queue: deque[W] = deque()
        self._running_priority: int | None = None  # during plan: the most urgent running job's

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    def enqueue(self, job: W) -> None:
        """Queue the job behind every waiting one of its priority or a more urgent one (lower)."""
        at = len(self._queue)
        while at and self._queue[at - 1].priority > job.priority:
            at -= 1
        self._queue.insert(at, job)

    def plan(self, load: LaneLoad[W], is_stopping: bool = False) -> list[Decision[W]]:
        """This turn's decisions, in queue order, the head first; what it starts is booked, what
        it pauses is released and queued again."""
        decisions: list[Decision[W]] = []
        serial, rows = load.serial_busy, load.batch_rows
        pausable = list(load.pausable)
        self._running_priority = load.running_priority
        while self._queue:
            decision = self._decide(self._queue[0], serial, rows, is_stopping)
            if decision is None:
                victims = self._victims(self._queue[0], pausable, serial, rows)
                if not victims:
                    break
                for job, lane in victims:
                    pausable.remove((job, lane))
                    decisions.append(Pause(job, lane))
                    self.kv.release(job.kv_need)
                    serial, rows = (False, rows) if lane == "serial" else (serial, rows - 1)
                    self.requeue(job)
                continue
            self._queue.popleft()
            decisions.append(decision)
            if isinstance(decision, Start):
                self.kv.book(decision.job.kv_need)
                serial, rows = (True, rows) if decision.lane == "serial" else (serial, rows + 1)
                p = decision.job.priority
                self._running_priority = p if self._running_priority is None else min(self._running_priority, p)
        return decisions

    def _urgent(self, job: W) -> bool:
        """Whether `job` (alone: not a choice of n) is more urgent than every running job (some job runs)."""
        return self._running_priority is not None and job.priority < self._running_priority and job.group_size == 1

    def _victims(self, head: W, pausable: list[tuple[W, LaneName]], serial: bool, rows: int) -> list[tuple[W, LaneName]]:
        """The fewest running jobs, less urgent than `head`, whose pause lets it start (least
        urgent first, the last started first among equals); none if pausing them all would not."""
        if head.is_cancelled:
            return []
        order = sorted(enumerate(pausable), key=lambda p: (-p[1][0].priority, -p[0]))
        chosen: list[tuple[W, LaneName]] = []
        free = self.kv.free
        for _, (job, lane) in order:
            if job.priority <= head.priority:
                break
            chosen.append((job, lane))
            free += job.kv_need
            serial, rows = (False, rows) if lane == "serial" else (serial, rows - 1)
            behind = max(len(self._queue) - 1, head.group_size - 1)
            if choose_lane(head.kv_need, LaneState(self.width, serial, rows, free, behind,
                                                   self._urgent(head))) is not None:
                return chosen
        return []

    def requeue(self, job: W) -> None:
        """A paused job waits again: ahead of every waiting job of its priority (it came first)."""
        at = 0
        while at < len(self._queue) and self._queue[at].priority < job.priority:
            at += 1
        self._queue.insert(at, job)

    def remove(self, job: W) -> None:
        """Take a job out of the queue (a pause that failed: its lane answered it)."""
        for at, queued in enumerate(self._queue):
            if queued is job:
                del self._queue[at]
                return

    def _decide(self, job: W, serial: bool, rows: int, is_stopping: bool) -> Decision[W] | None:
        if job.is_cancelled or is_stopping:
            return Drop(job)
        need = job.kv_need
        # The jobs behind this one come with it (a burst); a choice of n brings its siblings.
        behind = max(len(self._queue) - 1, job.group_size - 1)
        lane = choose_lane(need, LaneState(self.width, serial, rows, self.kv.free, behind, self._urgent(job)))
        if lane is not None:
            return Start(job, lane)
        if not serial and not rows:  # nothing runs and it still does not fit
            return Refuse(job, f"The request needs {need} tokens of KV; the budget is {self.kv.budget_tokens}.")
        return None

    def release(self, job: W) -> None:
        """A started job ended (or failed to start): its KV is free again."""
        self.kv.release(job.kv_need)

    def take_all(self) -> list[W]:
        """Empty the queue (the GPU thread is ending): the jobs that waited, in order."""
        jobs = list(self._queue)
        self._queue.clear()
        return jobs

    def refusal(self, num_prompt: int, max_tokens: int) -> APIError | None:
        """The 400 for a job whose KV could never fit the budget (before it is queued), or None."""
        need = kv_tokens(num_prompt, max_tokens)
        if self.kv.can_ever_fit(need):
            return None
        return APIError(
            400,
            f"This request needs {need} tokens of KV cache (a {num_prompt}-token prompt plus max_tokens "
            f"{max_tokens}), more than this engine's budget of {self.kv.budget_tokens}: a shorter prompt or "
            f"max_tokens fits; {self.short_budget_hint} (an engine run alone: --kv-budget-tokens).",
            param="messages", code="kv_budget_exceeded",
        )
