"""The GPU thread of an engine that serves an embedding model: requests batched into forwards.

The same outside as the generating engine's Gateway (health, stats, drain, stop), a simpler
loop inside: it blocks for a request, takes every other one queued by then, and runs their
inputs together, sorted by length and cut into forwards of at most BATCH_TOKENS padded tokens
(BATCH_ROWS rows). Requests that arrive while a forward runs make up the next batch, so
concurrent callers share forwards as rows of a continuous batch do. A request whose caller
left is dropped before its rows run.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mlxd.engine.cache.prefix_cache import FlushReport
from mlxd.engine.embed.model import EmbeddingModel
from mlxd.engine.gpu.gateway import STOPPING, Call, Flush, Gateway, Stop, _run_call, answer
from mlxd.engine.gpu.options import GatewayOptions
from mlxd.engine.gpu.stats import Stats
from mlxd.engine.models.load_meter import LoadMeter
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.protocol.errors import APIError
from mlxd.protocol.events import Failed

log = logging.getLogger("mlxd.engine")
BATCH_TOKENS = 16384  # padded tokens in one forward (rows x the longest row's tokens)
BATCH_ROWS = 256


@dataclass(eq=False)
class EmbedJob:
    """One request's inputs (token ids) and where its vectors go (rows in input order)."""

    rows: list[list[int]]
    done: concurrent.futures.Future[np.ndarray] = field(default_factory=concurrent.futures.Future)
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float = 0.0  # when its first forward began (GPU thread)


EmbedCommand = EmbedJob | Stop | Flush | Call


def batches(lengths: list[int], max_tokens: int = BATCH_TOKENS, max_rows: int = BATCH_ROWS) -> list[list[int]]:
    """Indices of rows of `lengths` grouped into forwards: longest first, each group's rows x
    its longest row within `max_tokens` (a row longer than that runs alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and len(groups[-1]) < max_rows and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def settle(future: concurrent.futures.Future[np.ndarray], value: np.ndarray | None = None,
           error: Exception | None = None) -> bool:
    """Answer `future` unless it is answered or cancelled already (either thread may be first)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)  # type: ignore[arg-type]
    except concurrent.futures.InvalidStateError:
        return False
    return True


def _no_language_model() -> LoadedModel:
    raise AssertionError("an embedding engine loads no language model")


class EmbedGateway(Gateway):
    """Owns the GPU thread of an embedding engine (module docstring)."""

    serves = "embeddings"

    def __init__(self, load: Callable[[], EmbeddingModel], stats: Stats, options: GatewayOptions,
                 meter: LoadMeter | None = None) -> None:
        super().__init__(_no_language_model, stats, options, meter)
        self._load_embedder = load
        self._queue: queue.SimpleQueue[EmbedCommand] = queue.SimpleQueue()
        self._jobs: set[EmbedJob] = set()  # loop thread: submitted, not yet answered
        self.embedder: EmbeddingModel | None = None

    @property
    def is_loaded(self) -> bool:
        return self.embedder is not None

    @property
    def is_serving(self) -> bool:
        return self.embedder is not None and not self.is_stopping and self._thread.is_alive()

    @property
    def context_window(self) -> int | None:
        return self.embedder.context_window if self.embedder is not None else None

    def embed(self, rows: list[list[int]]) -> concurrent.futures.Future[np.ndarray]:
        """Loop thread: queue `rows` for the GPU thread; the future gets their vectors (a 503
        when the engine is not serving)."""
        if not self.is_serving:
            raise APIError(503, STOPPING.message, type="server_error", code=STOPPING.code)
        job = EmbedJob(rows)
        self._stats.num_requests += 1
        self._stats.prompt_tokens += sum(len(r) for r in rows)
        self._jobs.add(job)
        job.done.add_done_callback(lambda _: self._jobs.discard(job))
        self._queue.put(job)
        return job.done

    def flush_cache(self, timeout_s: float) -> concurrent.futures.Future[FlushReport]:
        done: concurrent.futures.Future[FlushReport] = concurrent.futures.Future()
        answer(done, FlushReport())  # no prompt cache: nothing to write
        return done

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future[object]:
        command = Call(fn)
        if not self.is_serving:
            command.done.set_exception(APIError(503, STOPPING.message, type="server_error", code=STOPPING.code))
        else:
            self._queue.put(command)
        return command.done

    def stop(self) -> None:
        if self.is_stopping:
            return
        self._is_stopping = True
        self.abort_open(STOPPING)
        self._queue.put(Stop())

    def abort_open(self, event: Failed) -> int:
        """Loop thread: end every request not yet answered with `event` (a drain's timeout, a stop)."""
        waiting = [job for job in list(self._jobs) if not job.done.done()]
        for job in waiting:
            settle(job.done, error=APIError(event.status, event.message, type="server_error", code=event.code))
        return len(waiting)

    # --- the GPU thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._load_embedding_model():
                self._loop()
        except BaseException:
            log.critical("the GPU thread failed:\n%s", traceback.format_exc())
            raise
        finally:
            self._drop_queued()
            self.on_exit()

    def _load_embedding_model(self) -> bool:
        try:
            model = self._load_embedder()
            started = time.perf_counter()
            model.dimensions = int(model.forward([[model.tokens.pad_id] * 2]).shape[-1])  # compiles, and sizes
        except Exception as exc:
            self.load_error = str(exc) or type(exc).__name__
            log.error("model load failed: %s", self.load_error)
            self.meter.end()
            return False
        self.meter.end()
        log.info("embedding model: %d numbers a vector, pooling %s (from %s), window %d tokens; "
                 "first forward %.0f ms", model.dimensions, model.pooling.label, model.pooling.source,
                 model.context_window, (time.perf_counter() - started) * 1000)
        self.embedder = model
        gc.collect()
        gc.freeze()
        self.on_ready()
        return True

    def _loop(self) -> None:
        model = self.embedder
        assert model is not None
        while True:
            received = [self._queue.get()]
            while True:
                try:
                    received.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            jobs: list[EmbedJob] = []
            for command in received:
                if isinstance(command, Stop):
                    return
                if isinstance(command, Flush):
                    answer(command.done, FlushReport())
                elif isinstance(command, Call):
                    _run_call(command, skip=False)
                elif not command.done.done():  # its caller still waits
                    jobs.append(command)
                else:
                    self._stats.num_cancelled += 1
            if jobs:
                self._run_jobs(model, jobs)

    def _run_jobs(self, model: EmbeddingModel, jobs: list[EmbedJob]) -> None:
        """Every row of `jobs` embedded, in forwards of rows of similar length; each job answered."""
        started = time.perf_counter()
        self._stats.turn_started(started)
        rows = [(j, r) for j, job in enumerate(jobs) for r in range(len(job.rows))]
        out: list[np.ndarray | None] = [None] * len(rows)
        failed: Exception | None = None
        try:
            for group in batches([len(jobs[j].rows[r]) for j, r in rows]):
                vectors = model.forward([jobs[rows[i][0]].rows[rows[i][1]] for i in group])
                for k, i in enumerate(group):
                    out[i] = vectors[k]
        except Exception as exc:  # e.g. memory for a huge batch: these requests fail, the engine goes on
            log.exception("embedding forward failed")
            failed = exc
        at = 0
        for job in jobs:
            if failed is not None:
                self._stats.num_failed += 1
                settle(job.done, error=APIError(500, f"The embedding forward failed: {failed}", type="server_error"))
            elif settle(job.done, np.stack([v for v in out[at:at + len(job.rows)] if v is not None])):
                self._stats.num_completed += 1
            else:  # its caller left, or an abort answered it, while it ran
                self._stats.num_cancelled += 1
            at += len(job.rows)
        self._stats.last_timings_ms = {"queue": round((started - min(j.queued_at for j in jobs)) * 1000, 3),
                                       "embed": round((time.perf_counter() - started) * 1000, 3)}
        self._stats.last_finish_reason = "stop"
        self._stats.turn_ended(time.perf_counter())

    def _drop_queued(self) -> None:
        while True:
            try:
                command = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Flush):
                answer(command.done, FlushReport(complete=False))
            elif isinstance(command, Call):
                _run_call(command, skip=True)
            elif isinstance(command, EmbedJob):
                settle(command.done, error=APIError(503, STOPPING.message, type="server_error", code=STOPPING.code))
