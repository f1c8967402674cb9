"""The GPU gateway: the one thread that touches MLX, advancing its lanes a step at a time.

Each turn the thread takes what its inbox holds (blocking only when it has nothing to run),
then has its Runner start the waiting jobs the scheduler lets in (scheduler.py: queue order,
KV booking, lane choice) and step each lane that has work: the serial lane a prefill chunk or
one token, the batch lane one token for every row plus a prefill chunk. So requests join and
leave between steps, a cancelled request leaves at the next one, and a command waits at most
a chunk. Loading the model and the warm-up are loader.py's; this class is the loop.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxd.engine.cache.live_rows import restore_interrupted
from mlxd.engine.cache.prefix_cache import FlushReport, PrefixCache
from mlxd.engine.gpu.job import Job
from mlxd.engine.gpu.loader import make_runner, open_model, size_options
from mlxd.engine.gpu.options import GatewayOptions
from mlxd.engine.gpu.runner import Runner
from mlxd.engine.gpu.sequence import Sequence
from mlxd.engine.gpu.stats import Stats
from mlxd.engine.gpu.ticket import Ticket
from mlxd.engine.gpu.trace import StepTrace
from mlxd.engine.models.load_meter import LoadMeter
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.protocol.errors import APIError
from mlxd.protocol.events import Failed
from mlxd.protocol.sizing import Sizing
from mlxd.protocol.stats import LaneStats

__all__ = ["STOPPING", "Flush", "Gateway", "GatewayOptions", "Stop"]
log = logging.getLogger("mlxd.engine")
STOPPING = Failed("The engine is shutting down.", 503, "engine_stopping")
GPU_THREAD_DIED = "The engine's GPU thread stopped."


def group_refuses(what: str) -> APIError:
    return APIError(400, f"A model served by an engine group does not take {what} yet (docs/distributed.md).",
                    code="unsupported_in_group")
# After sequences last ran (or waited) two or more at once, for this long a request that finds
# the engine idle may be the first of a burst: the gateway gathers its companions (--gather-ms).
BURST_MEMORY_S = 10.0


@dataclass(frozen=True, slots=True)
class Stop:
    """Inbox command: end the GPU thread."""


@dataclass(frozen=True, slots=True)
class Flush:
    """Inbox command: write every prompt-cache entry not yet on SSD; the report goes to `done`."""

    timeout_s: float
    done: concurrent.futures.Future[FlushReport] = field(default_factory=concurrent.futures.Future)


@dataclass(frozen=True, slots=True)
class Call:
    """Inbox command: run `fn` on the GPU thread between turns (mounting an adapter); its result
    or exception goes to `done`."""

    fn: Callable[[], Any]
    done: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


# What the loop thread sends the GPU thread (a Sequence: a job, made when it was submitted).
Command = Sequence | Stop | Flush | Call
# While the SSD writer holds a write-behind entry and more wait, the idle GPU thread checks
# this often whether it can hand over the next.
WRITER_POLL_S = 0.05


def answer(future: concurrent.futures.Future[FlushReport], report: FlushReport) -> None:
    """Set a Flush's report unless its asker gave up (a cancelled future refuses a result)."""
    if future.set_running_or_notify_cancel():
        future.set_result(report)


class Gateway:
    """Owns the GPU thread: loads the model on it (loader.py), then runs the loop: the inbox, the
    commands, and the Runner's turns."""

    serves = "generation"  # what its model does (an embedding model's engine: embed/gateway.py)

    def __init__(
        self, load: Callable[[], LoadedModel], stats: Stats, options: GatewayOptions, meter: LoadMeter | None = None
    ) -> None:
        self._load = load
        self.meter = meter or LoadMeter()  # the load's progress, for /health
        self._stats = stats
        self._options = options
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mlxd-gpu", daemon=True)
        self._open: weakref.WeakSet[Ticket] = weakref.WeakSet()  # loop thread only
        self._is_stopping = False
        self.loaded: LoadedModel | None = None
        self.load_error: str | None = None
        self.on_ready: Callable[[], None] = lambda: None  # GPU thread, once the model is loaded
        self.on_exit: Callable[[], None] = lambda: None  # GPU thread, as it ends
        # Set on the GPU thread before `loaded`; the loop thread reads its counts and budget.
        self._runner: Runner | None = None
        # GPU thread only:
        self._bursts_until = 0.0  # while now is before this, arrivals have lately come together
        self._idle = threading.Event()  # set while the GPU thread has nothing to run (the SSD writer works then)
        self.prompt_cache: PrefixCache | None = None  # set once loaded; snapshot() may be read by the loop
        self.sizing: Sizing | None = None  # the width and KV budget chosen at load (then in _options too)
        self.group: Any = None  # rank 0 of an engine group: its group/ranks.py Leader (set before start)

    def start(self) -> None:
        """Start the GPU thread: it loads the model, serves jobs, and calls `on_exit` when it ends."""
        self._thread.start()

    @property
    def is_stopping(self) -> bool:
        return self._is_stopping

    @property
    def is_loaded(self) -> bool:
        return self.loaded is not None

    @property
    def context_window(self) -> int | None:
        return self.loaded.context_window if self.loaded is not None else None

    @property
    def is_serving(self) -> bool:
        """Loaded, not stopping, and the GPU thread is alive."""
        return self.loaded is not None and not self._is_stopping and self._thread.is_alive()

    @property
    def kv_budget(self) -> int | None:
        """Tokens of KV the engine books for running sequences at most (None until loaded)."""
        return self._runner.scheduler.kv.budget_tokens if self._runner is not None else None

    def snapshot(self) -> LaneStats:
        """The lanes for /admin/stats (read on the loop thread; each value is one read)."""
        runner = self._runner
        kv = runner.scheduler.kv if runner is not None else None
        return LaneStats(
            width=self._options.batch or 0,
            serial=runner.rows_in("serial") if runner is not None else 0,
            batch=runner.rows_in("batch") if runner is not None else 0,
            waiting=(runner.scheduler.num_waiting if runner is not None else 0) + self._inbox.qsize(),
            kv_budget_tokens=kv.budget_tokens if kv is not None else None,
            kv_booked_tokens=kv.booked if kv is not None else None,
            sizing=self.sizing.why if self.sizing is not None else None,
            paused=runner.num_paused if runner is not None else 0,
            paused_total=self._stats.num_paused,
            resumed_total=self._stats.num_resumed,
            shared_prefills=self._stats.shared_prefills,
            shared_tokens=self._stats.shared_tokens,
            image_batches=self._stats.image_batches,
            image_batch_rows=self._stats.image_batch_rows,
            draft=self._options.draft.label,
            draft_proposed=self._stats.draft_proposed,
            draft_accepted=self._stats.draft_accepted,
            draft_batch_passes=self._stats.draft_batch_passes,
            draft_batch_idle_reads=self._stats.draft_batch_idle_reads,
            rows_lingered=self._stats.rows_lingered,
            **_adapter_stats(self.loaded),
        )

    def flush_cache(self, timeout_s: float) -> concurrent.futures.Future[FlushReport]:
        """Loop thread: have the GPU thread write the prompt cache's RAM entries to SSD (a drain,
        a stop); the future gets the report (entries, bytes, ms, complete)."""
        command = Flush(timeout_s)
        if self.loaded is None or not self._thread.is_alive():
            answer(command.done, FlushReport())
        else:
            self._inbox.put(command)  # the caller bounds its wait: a thread ending now never answers
        return command.done

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Loop thread: run `fn` on the GPU thread before its next turn; the future gets what it
        returns or raises (503 when the engine is not serving)."""
        command = Call(fn)
        if self.group is not None:  # a closure cannot be sent to the other ranks
            command.done.set_exception(group_refuses("adapter mounts or the curve designer's passes"))
        elif not self.is_serving:
            command.done.set_exception(APIError(503, STOPPING.message, type="server_error", code=STOPPING.code))
        else:
            self._inbox.put(command)
        return command.done

    def submit(self, job: Job) -> None:
        """Queue a job for the GPU thread (loop thread only); 503 when not serving, 400 if it can never fit."""
        loaded, runner = self.loaded, self._runner
        if not self.is_serving or loaded is None or runner is None:
            raise APIError(503, STOPPING.message, type="server_error", code=STOPPING.code)
        if refusal := runner.scheduler.refusal(len(job.prompt), job.max_tokens):
            raise refusal
        if self.group is not None and (job.media is not None or job.adapters or
                                       (job.grammar is not None and job.grammar_text is None)):
            raise group_refuses("images, adapters or this grammar")
        self._stats.num_requests += 1
        self._stats.prompt_tokens += len(job.prompt)
        if job.resumed:  # a reply continued after its engine died (http/resume.py)
            self._stats.num_continued += 1
            self._stats.continued_tokens += job.resumed
        self._open.add(job.ticket)
        if self.group is not None:
            self.group.adopt(job)
        self._inbox.put(Sequence(job, loaded.tokenizer, loaded.eos_token_ids))

    def join(self, timeout_s: float) -> None:
        """Wait for the GPU thread to end (an engine group's rank 0: its last turn tells the others)."""
        self._thread.join(timeout_s)

    def stop(self) -> None:
        """Loop thread: end every open request now (503), and tell the GPU thread to finish."""
        if self._is_stopping:
            return
        self._is_stopping = True
        self.abort_open(STOPPING)
        self._inbox.put(Stop())

    def abort_open(self, event: Failed) -> int:
        """Loop thread: end every request still waiting on its ticket with `event`; keep serving.

        The GPU thread sees the tickets cancelled and drops their sequences at its next step.
        """
        # A cancelled ticket's handler has left (client gone) or was already answered.
        waiting = [t for t in list(self._open) if not t.is_finished and not t.is_cancelled]
        for ticket in waiting:
            ticket.abort(event)
        return len(waiting)

    # --- the GPU thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._load_model():
                self._serve()
        except BaseException:
            # In the log before anything else: the process ends as soon as this thread does.
            log.critical("the GPU thread failed:\n%s", traceback.format_exc())
            if self._runner is not None:
                self._runner.fail_running(GPU_THREAD_DIED, "engine_failed")
            raise
        finally:
            if self.group is not None:
                self.group.close()
            self._fail_queued()
            self.on_exit()

    def _load_model(self) -> bool:
        try:
            loaded = open_model(self._load, self._options)
            if self.group is not None:  # the other ranks loaded their shards too, or say why not
                self.group.join()
        except Exception as exc:
            self.load_error = str(exc) or type(exc).__name__
            log.error("model load failed: %s", self.load_error)
            self.meter.end()
            return False
        self._options, self.sizing = size_options(loaded, self._options)
        self._runner, self.prompt_cache = make_runner(loaded, self._stats, self._options, self.sizing, self.meter,
                                                      self._idle)
        if self.group is not None:
            self.group.hello(self._options, len(getattr(loaded.model, "layers", ())), self.prompt_cache)
        else:  # the checkpoints of replies the last engine was running: in RAM before they come back
            restore_interrupted(self.prompt_cache)
        self.meter.end()
        self.loaded = loaded
        # What exists now (the model, tokenizer, kernels) lives as long as the engine: kept out of
        # the collector's full passes, which otherwise walk it all and stall a decode step.
        gc.collect()
        gc.freeze()
        self.on_ready()
        return True

    def _serve(self) -> None:
        runner, trace = self._runner, StepTrace.from_env()
        assert runner is not None
        while True:
            idle = not runner.has_work
            if idle:
                self._idle.set()
                # Write-behind: while there is an entry to write, look at the inbox between
                # hand-overs (or every 50 ms while the writer is at one) instead of blocking.
                wrote = self._write_behind()
                received = self._receive(block=wrote == "none", timeout=WRITER_POLL_S if wrote == "busy" else None)
                if not received:
                    continue
            else:
                received = self._receive(block=False)
            if idle and self._in_bursts():
                received += self._gather(len(received))
            self._idle.clear()
            stopping = self._is_stopping
            if self.group is not None and not any(isinstance(c, Stop) for c in received):
                self.group.turn(received, stopping)  # the other ranks start this turn from the same
            stop = False
            for command in received:
                if isinstance(command, Stop):
                    stop = True
                elif isinstance(command, Flush):
                    self._flush(command, skip=stop)
                elif isinstance(command, Call):
                    _run_call(command, skip=stop)
                else:
                    runner.enqueue(command)  # after a Stop: answered by _fail_queued
            if stop:
                return
            self._turn(runner, trace, len(received), stopping)

    def _write_behind(self) -> str:
        """Idle: hand the SSD writer the checkpoints taken, and a prompt-cache entry
        (PrefixCache.write_behind's answer)."""
        cache = self.prompt_cache
        if cache is None:
            return "none"
        try:
            if not self._options.write_behind:
                cache.send_checkpoints(everything=True)  # idle: no step to hide a read behind
                return "none"
            return cache.write_behind()
        except Exception:
            log.exception("SSD prompt cache: write-behind failed")
            return "none"

    def _flush(self, command: Flush, skip: bool = False) -> None:
        cache = self.prompt_cache
        report = FlushReport(complete=not skip)
        try:
            if cache is not None and not skip:
                report = cache.flush(command.timeout_s)
        except Exception:
            log.exception("SSD prompt cache: flush failed")
            report = FlushReport(complete=False, errors=1)
        if report.entries:
            log.info("prompt cache: wrote %d entries (%.1f MB) to SSD in %.0f ms", report.entries,
                     report.bytes / 1e6, report.ms)
        answer(command.done, report)

    def _turn(self, runner: Runner, trace: StepTrace | None, received: int, stopping: bool) -> None:
        """Start what fits, then step each lane once; the time goes to busy_s (and the trace)."""
        started = time.perf_counter()
        self._stats.turn_started(started)
        admitted = runner.turn(stopping)
        waiting = runner.scheduler.num_waiting
        if runner.num_rows + waiting >= 2:
            self._bursts_until = time.monotonic() + BURST_MEMORY_S
        ended_at = time.perf_counter()
        self._stats.turn_ended(ended_at)  # the GPU thread's time at work
        if trace is not None:
            trace.turn(started, ended_at, received=received, admitted=admitted, waiting=waiting,
                       serial=runner.rows_in("serial"), batch=runner.rows_in("batch"),
                       prefilling=runner.num_prefilling, ended=runner.num_ended,
                       passes=self._stats.draft_batch_passes, idle_reads=self._stats.draft_batch_idle_reads,
                       lingered=self._stats.rows_lingered)

    def _in_bursts(self) -> bool:
        return self._options.gather_ms > 0 and (self._options.batch or 1) > 1 and time.monotonic() < self._bursts_until

    def _gather(self, have: int) -> list[Command]:
        """The rest of a burst: wait up to gather_ms for each next arrival (4x that in all),
        until the batch width is reached, so that the burst starts as one batched prefill
        instead of its first request prefilling alone while the others wait for it."""
        gap = self._options.gather_ms / 1000
        deadline = time.monotonic() + 4 * gap
        more: list[Command] = []
        while have + len(more) < (self._options.batch or 1):
            wait = min(gap, deadline - time.monotonic())
            if wait <= 0:
                break
            try:
                command = self._inbox.get(timeout=wait)
            except queue.Empty:
                break
            more.append(command)
            if isinstance(command, Stop):
                break
        return more

    def _receive(self, block: bool, timeout: float | None = None) -> list[Command]:
        """What the inbox holds; with `block`, wait for at least one command; with `timeout`,
        wait that long for one."""
        commands: list[Command] = []
        if block:
            commands.append(self._inbox.get())
        elif timeout is not None:
            try:
                commands.append(self._inbox.get(timeout=timeout))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _fail_queued(self) -> None:
        # Whatever waits or is still in the inbox when the thread ends would otherwise wait forever.
        if self._runner is not None:
            self._runner.abandon_waiting(STOPPING)
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Sequence):
                command.abandon(STOPPING)
            elif isinstance(command, Flush):
                answer(command.done, FlushReport(complete=False))
            elif isinstance(command, Call):
                _run_call(command, skip=True)


def _adapter_stats(loaded: LoadedModel | None) -> dict[str, int]:
    bank = loaded.adapters if loaded is not None else None
    if bank is None:
        return {}
    mounted = list(bank.mounted.values())
    return {"adapters": len(mounted), "adapter_bytes": sum(a.nbytes for a in mounted),
            "adapter_mixed_passes": bank.mixed_passes, "adapter_merged_bytes": bank.merged_bytes}


def _run_call(command: Call, skip: bool) -> None:
    """Run a Call's function (`skip`: the thread is ending; answer 503) into its future."""
    if not command.done.set_running_or_notify_cancel():
        return
    if skip:
        command.done.set_exception(APIError(503, STOPPING.message, type="server_error", code=STOPPING.code))
        return
    try:
        command.done.set_result(command.fn())
    except Exception as exc:  # the caller decides what it means
        command.done.set_exception(exc)
