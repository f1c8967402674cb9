"""The admission gate: which inference requests may start, drains, and the exclusive lease."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass

from mlxd.engine.cache.prefix_cache import FlushReport
from mlxd.engine.gpu.stats import Stats
from mlxd.protocol.errors import APIError
from mlxd.protocol.events import Failed
from mlxd.protocol.process import LEASE_HEADER, DrainResult, Refusal
from mlxd.protocol.stats import AdmissionStats, GateState

log = logging.getLogger("mlxd.engine")
DRAIN_TIMEOUT = Failed("The engine drained and its timeout cut this request short.", 503, "drain_timeout")
# Aborted requests end within a step; this bounds a drain if a handler is stuck writing to a
# client that stopped reading.
ABORT_GRACE_S = 5.0
FLUSH_MIN_S = 1.0  # a drain whose requests used up its timeout still gets this long to write the cache
@dataclass(frozen=True, slots=True)
class Lease:
    token: str
    holder: str


class Slot:
    """One admitted request: whether it reached the GPU queue, and whether a drain cut it off."""

    __slots__ = ("aborted", "is_submitted")

    def __init__(self) -> None:
        self.is_submitted = False
        self.aborted: Failed | None = None

    def enter_gpu(self) -> None:
        """Call right before submitting the job: 503 if a drain already gave up on this request."""
        if self.aborted is not None:
            raise APIError(503, self.aborted.message, type="server_error", code=self.aborted.code)
        self.is_submitted = True


def rejection(is_draining: bool, lease: Lease | None, presented: str | None) -> Refusal | None:
    """Why a request may not start (`draining` / `leased`), or None to admit it."""
    if is_draining:
        return "draining"  # a drain overrides a lease: the holder is refused too
    if lease is not None and presented != lease.token:
        return "leased"
    return None


def state_name(is_draining: bool, lease: Lease | None) -> GateState:
    """The gate's state as /admin/stats reports it."""
    return "draining" if is_draining else "leased" if lease is not None else "open"


_MESSAGES: dict[Refusal, str] = {
    "draining": "The engine is draining and admits no new requests.",
    "leased": "The engine is leased for exclusive use.",
}


class Admission:
    """Counts inference requests in flight and decides which may start (drain, lease)."""

    def __init__(
        self, abort_open: Callable[[Failed], int], stats: Stats,
        flush_cache: Callable[[float], Awaitable[FlushReport]] | None = None,
    ) -> None:
        self._abort_open = abort_open  # Gateway.abort_open: ends the open tickets with an event
        self._flush_cache = flush_cache  # writes the prompt cache's RAM entries to SSD: its report
        self._stats = stats
        self._slots: set[Slot] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._is_draining = False
        self._lease: Lease | None = None
        self._drain_lock = asyncio.Lock()
        self._lease_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[DrainResult]] = set()

    @property
    def is_draining(self) -> bool:
        return self._is_draining

    @property
    def num_in_flight(self) -> int:
        return len(self._slots)

    @contextlib.contextmanager
    def admit(self, headers: Mapping[str, str]) -> Iterator[Slot]:
        """Hold a slot for one inference request; 503 `draining`/`leased` when it may not start."""
        if code := rejection(self._is_draining, self._lease, headers.get(LEASE_HEADER)):
            self._count_rejection(code)
            raise APIError(503, _MESSAGES[code], type="server_error", code=code, headers={"Retry-After": "1"})
        slot = Slot()
        self._slots.add(slot)
        self._idle.clear()
        try:
            yield slot
        finally:
            self._slots.discard(slot)
            if not self._slots:
                self._idle.set()

    def _count_rejection(self, code: Refusal) -> None:
        if code == "draining":
            self._stats.num_rejected_draining += 1
        else:
            self._stats.num_rejected_leased += 1

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False if `timeout_s` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def drain(self, timeout_s: float, resume: bool) -> DrainResult:
        """Run a drain to its end even if the caller goes away (a task, shielded)."""
        task = asyncio.create_task(self._drain(timeout_s, resume))
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _drain(self, timeout_s: float, resume: bool) -> DrainResult:
        async with self._drain_lock:  # one drain at a time; a second one runs after the first
            started = time.perf_counter()
            self._is_draining = True
            try:
                num_started, num_cancelled = self.num_in_flight, 0
                is_idle = await self.wait_idle(timeout_s)
                if not is_idle:
                    num_cancelled = self._abort_in_flight()
                    is_idle = await self.wait_idle(ABORT_GRACE_S)
                # Nothing runs now: the prompt cache's entries go to SSD before the answer, in
                # what is left of the timeout (at least a second).
                left = max(FLUSH_MIN_S, timeout_s - (time.perf_counter() - started))
                report = await self._flush_cache(left) if self._flush_cache is not None else FlushReport()
            finally:
                self._is_draining = not resume
            waited_ms = round((time.perf_counter() - started) * 1000, 3)
            result = DrainResult(
                is_idle, num_started - num_cancelled, num_cancelled, waited_ms, report.bytes, resume,
                cache_written_entries=report.entries, cache_write_ms=report.ms, cache_complete=report.complete,
            )
            log.info("drained in %.0f ms: %d finished, %d cancelled; %s", waited_ms, result.finished,
                     num_cancelled, "resumed" if resume else "admitting nothing")
            return result

    def _abort_in_flight(self) -> int:
        """End every request still in flight with `drain_timeout`; return how many."""
        pending = [slot for slot in self._slots if not slot.is_submitted]
        for slot in pending:  # admitted but not yet queued (reading its body): refused at submit
            slot.aborted = DRAIN_TIMEOUT
        return len(pending) + self._abort_open(DRAIN_TIMEOUT)

    @contextlib.asynccontextmanager
    async def lease(self, holder: str, wait_s: float) -> AsyncIterator[str]:
        """Hold the exclusive lease (a token to present in `X-MLXD-Lease`) for the block."""
        deadline = asyncio.get_running_loop().time() + wait_s
        try:
            async with asyncio.timeout_at(deadline):
                await self._lease_lock.acquire()
        except TimeoutError:
            raise _lease_error("lease_busy", f"Another lease is held; waited {wait_s:g} s.") from None
        try:
            self._lease = lease = Lease(secrets.token_urlsafe(24), holder)  # closes the gate to others
            if not await self.wait_idle(deadline - asyncio.get_running_loop().time()):
                raise _lease_error("lease_timeout", f"Requests in flight did not finish within {wait_s:g} s.")
            yield lease.token
        finally:
            self._lease = None
            self._lease_lock.release()

    def snapshot(self) -> AdmissionStats:
        """The gate for /admin/stats."""
        return AdmissionStats(
            state_name(self._is_draining, self._lease), self.num_in_flight, self._stats.num_rejected_draining,
            self._stats.num_rejected_leased, self._lease.holder if self._lease else None,
        )


def _lease_error(code: str, message: str) -> APIError:
    return APIError(503, message, type="server_error", code=code, headers={"Retry-After": "1"})
