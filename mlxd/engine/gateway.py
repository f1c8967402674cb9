"""The GPU gateway: the one thread that touches MLX, fed through a queue of jobs."""

from __future__ import annotations

import logging
import queue
import threading
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from mlxd.engine.job import Job
from mlxd.engine.loaded_model import LoadedModel, wire_model_memory
from mlxd.engine.serial_lane import SerialLane
from mlxd.engine.stats import Stats
from mlxd.engine.ticket import Ticket
from mlxd.protocol.errors import APIError
from mlxd.protocol.events import Done, Failed

log = logging.getLogger("mlxd.engine")
STOPPING = Failed("The engine is shutting down.", 503, "engine_stopping")


@dataclass(frozen=True, slots=True)
class _Stop:
    """Sent to the GPU thread to end it."""


def choose_lane(job: Job) -> str:
    """Which lane runs `job`. The batch lane (continuous batching) slots in here."""
    return "serial"


class Gateway:
    """Owns the GPU thread: loads the model on it, then runs jobs one lane at a time."""

    def __init__(self, load: Callable[[], LoadedModel], stats: Stats, prefill_step: int) -> None:
        self._load = load
        self._stats = stats
        self._prefill_step = prefill_step
        self._inbox: queue.SimpleQueue[Job | _Stop] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mlxd-gpu", daemon=True)
        self._open: weakref.WeakSet[Ticket] = weakref.WeakSet()  # loop thread only
        self._is_stopping = False
        self.loaded: LoadedModel | None = None
        self.load_error: str | None = None
        self.on_ready: Callable[[], None] = lambda: None  # GPU thread, once the model is loaded
        self.on_exit: Callable[[], None] = lambda: None  # GPU thread, as it ends

    def start(self) -> None:
        """Start the GPU thread: it loads the model, serves jobs, and calls `on_exit` when it ends."""
        self._thread.start()

    @property
    def is_stopping(self) -> bool:
        return self._is_stopping

    @property
    def is_serving(self) -> bool:
        """Loaded, not stopping, and the GPU thread is alive."""
        return self.loaded is not None and not self._is_stopping and self._thread.is_alive()

    def submit(self, job: Job) -> None:
        """Queue a job for the GPU thread (loop thread only); 503 when not serving."""
        if not self.is_serving:
            raise APIError(503, STOPPING.message, type="server_error", code=STOPPING.code)
        self._stats.num_requests += 1
        self._stats.prompt_tokens += len(job.prompt)
        self._open.add(job.ticket)
        self._inbox.put(job)

    def stop(self) -> None:
        """Loop thread: end every open request now (503), and tell the GPU thread to finish."""
        if self._is_stopping:
            return
        self._is_stopping = True
        self.abort_open(STOPPING)
        self._inbox.put(_Stop())

    def abort_open(self, event: Failed) -> int:
        """Loop thread: end every request still waiting on its ticket with `event`; keep serving."""
        # A cancelled ticket's handler has left (client gone) or was already answered.
        waiting = [t for t in list(self._open) if not t.is_finished and not t.is_cancelled]
        for ticket in waiting:
            ticket.abort(event)
        return len(waiting)

    def _run(self) -> None:
        try:
            if self._load_model():
                self._serve()
        finally:
            self._fail_queued()
            self.on_exit()

    def _load_model(self) -> bool:
        try:
            self.loaded = self._load()
            wire_model_memory()
        except Exception as exc:
            self.load_error = str(exc) or type(exc).__name__
            log.error("model load failed: %s", self.load_error)
            return False
        self.on_ready()
        return True

    def _serve(self) -> None:
        assert self.loaded is not None
        lanes = {"serial": SerialLane(self.loaded, self._stats, self._prefill_step)}
        while not isinstance(job := self._inbox.get(), _Stop):
            try:
                self._run_job(lanes[choose_lane(job)], job)
            except BaseException:
                job.ticket.emit(Failed("The engine's GPU thread stopped.", 500, "engine_failed"))
                raise

    def _run_job(self, lane: SerialLane, job: Job) -> None:
        try:
            if job.ticket.is_cancelled or self._is_stopping:
                self._stats.num_cancelled += 1
                job.ticket.emit(Done("cancelled", len(job.prompt), 0))
            else:
                lane.run(job)
        except Exception as exc:
            log.error("generation failed:\n%s", traceback.format_exc())
            self._stats.num_failed += 1
            job.ticket.emit(Failed(f"generation failed: {type(exc).__name__}: {exc}"))

    def _fail_queued(self) -> None:
        # Whatever is still queued when the thread ends would otherwise wait forever.
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, Job):
                job.ticket.emit(STOPPING)
