"""The GPU gateway: the one thread that touches MLX, fed through a queue of jobs."""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from mlxd.engine.job import Job
from mlxd.engine.loaded_model import LoadedModel, wire_model_memory
from mlxd.engine.serial_lane import SerialLane
from mlxd.engine.stats import Stats
from mlxd.protocol.events import Done, Failed

log = logging.getLogger("mlxd.engine")


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
        self._current: Job | None = None
        self._is_stopping = False
        self.loaded: LoadedModel | None = None
        self.load_error: str | None = None
        self.on_loaded: Callable[[], None] = lambda: None

    def start(self) -> None:
        """Start the GPU thread; it loads the model first, then calls `on_loaded`."""
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job for the GPU thread (any thread)."""
        self._stats.num_requests += 1
        self._stats.prompt_tokens += len(job.prompt)
        self._inbox.put(job)

    def stop(self, timeout: float) -> None:
        """Cancel running and queued jobs, end the GPU thread, wait up to `timeout` seconds."""
        self._is_stopping = True
        if self._current is not None:
            self._current.ticket.cancel()
        self._inbox.put(_Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self.loaded = self._load()
            wire_model_memory()
        except Exception as exc:
            self.load_error = str(exc) or type(exc).__name__
            log.error("model load failed: %s", self.load_error)
        finally:
            self.on_loaded()
        if self.loaded is None:
            return
        lanes = {"serial": SerialLane(self.loaded, self._stats, self._prefill_step)}
        while not isinstance(job := self._inbox.get(), _Stop):
            self._current = job
            self._run_job(lanes[choose_lane(job)], job)
            self._current = None

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
