"""The GPU gateway: the one thread that touches MLX, advancing its lanes a step at a time.

Each turn the thread takes what its inbox holds (blocking only when it has nothing to run),
starts the waiting jobs that fit (scheduling.py decides the lane and the KV booking), then
steps each lane that has work: the serial lane one token, the batch lane one token for every
row plus a prefill chunk. So requests join and leave between steps, and a cancelled request
leaves at the next one.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import os
import queue
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from mlxd.engine import mlx_env
from mlxd.engine.cache.fingerprint import tier_dir
from mlxd.engine.cache.prefix_cache import FlushReport, PrefixCache
from mlxd.engine.cache.ssd_tier import SsdTier, default_ssd_cache_bytes
from mlxd.engine.gpu import decode_attention
from mlxd.engine.gpu.batch_lane import BatchLane
from mlxd.engine.gpu.flat_rows import FLATTEN_MIN_ROWS, flatten_quantized_rows, wins_here
from mlxd.engine.gpu.job import Job
from mlxd.engine.gpu.kv_quant import activation_dtype, check_quantized_kv
from mlxd.engine.gpu.scheduling import KvLedger, LaneState, choose_lane, kv_tokens
from mlxd.engine.gpu.sequence import Sequence
from mlxd.engine.gpu.serial_lane import SerialLane
from mlxd.engine.gpu.stats import Stats
from mlxd.engine.gpu.ticket import Ticket
from mlxd.engine.gpu.trace import StepTrace
from mlxd.engine.gpu.warmup import wanted, waves
from mlxd.engine.models.load_meter import LoadMeter
from mlxd.engine.models.loaded_model import LoadedModel, wire_model_memory
from mlxd.protocol.errors import APIError
from mlxd.protocol.events import Done, Failed
from mlxd.protocol.memory import kv_budget_tokens
from mlxd.protocol.stats import LaneStats

log = logging.getLogger("mlxd.engine")
STOPPING = Failed("The engine is shutting down.", 503, "engine_stopping")
GPU_THREAD_DIED = "The engine's GPU thread stopped."
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


# What the loop thread sends the GPU thread.
Command = Job | Stop | Flush
# While the SSD writer holds a write-behind entry and more wait, the idle GPU thread checks
# this often whether it can hand over the next.
WRITER_POLL_S = 0.05


def answer(future: concurrent.futures.Future[FlushReport], report: FlushReport) -> None:
    """Set a Flush's report unless its asker gave up (a cancelled future refuses a result)."""
    if future.set_running_or_notify_cancel():
        future.set_result(report)


@dataclass(frozen=True, slots=True)
class GatewayOptions:
    prefill_step: int = 512
    batch: int = 1  # sequences at once; 1 keeps to the serial lane
    max_context: int | None = None
    kv_budget_tokens: int | None = None  # None: protocol.memory's default for the window and batch
    warmup: str = "auto"  # run warm-up jobs through the lanes at load: on, off, auto (CUDA only); warmup.py
    gather_ms: float = 5.0  # in a burst, an idle engine waits this long for the next arrival (0: never)
    prompt_cache_bytes: int = 512 * 1024 * 1024  # the prompt cache's RAM tier (0: no prompt cache)
    ssd_root: Path | None = None  # the SSD tier's root (its dir is root/<fingerprint>); None: no SSD tier
    ssd_cache_bytes: int | None = None  # None: default_ssd_cache_bytes
    kv_bits: int | None = None  # quantized KV (the serial lane only: batch must be 1)
    kv_group_size: int = 64
    write_behind: bool = True  # idle: write new entries to SSD (off: drains, evictions and stops only)


class Gateway:
    """Owns the GPU thread: loads the model on it, then runs the lanes step by step."""

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
        self.kv: KvLedger | None = None  # set once loaded; its budget is read by the loop thread
        self.on_ready: Callable[[], None] = lambda: None  # GPU thread, once the model is loaded
        self.on_exit: Callable[[], None] = lambda: None  # GPU thread, as it ends
        # GPU thread only:
        self._waiting: deque[Job] = deque()
        self._serial: SerialLane | None = None
        self._batch: BatchLane | None = None
        self._bursts_until = 0.0  # while now is before this, arrivals have lately come together
        self._idle = threading.Event()  # set while the GPU thread has nothing to run (the SSD writer works then)
        self.prompt_cache: PrefixCache | None = None  # set once loaded; snapshot() may be read by the loop

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

    @property
    def kv_budget(self) -> int | None:
        """Tokens of KV the engine books for running sequences at most (None until loaded)."""
        return self.kv.budget_tokens if self.kv is not None else None

    def snapshot(self) -> LaneStats:
        """The lanes for /admin/stats (read on the loop thread; each value is one read)."""
        kv = self.kv
        return LaneStats(
            width=self._options.batch,
            serial=self._serial.num_rows if self._serial is not None else 0,
            batch=self._batch.num_rows if self._batch is not None else 0,
            waiting=len(self._waiting) + self._inbox.qsize(),
            kv_budget_tokens=kv.budget_tokens if kv is not None else None,
            kv_booked_tokens=kv.booked if kv is not None else None,
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

    def submit(self, job: Job) -> None:
        """Queue a job for the GPU thread (loop thread only); 503 when not serving, 400 if it can never fit."""
        if not self.is_serving:
            raise APIError(503, STOPPING.message, type="server_error", code=STOPPING.code)
        need = kv_tokens(len(job.prompt), job.max_tokens)
        if self.kv is not None and not self.kv.can_ever_fit(need):
            raise APIError(
                400,
                f"This request needs {need} tokens of KV cache (a {len(job.prompt)}-token prompt plus max_tokens "
                f"{job.max_tokens}), more than this engine's budget of {self.kv.budget_tokens} "
                "(a shorter prompt fits; --kv-budget-tokens raises it).",
                param="messages", code="kv_budget_exceeded",
            )
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
            self._fail_running(GPU_THREAD_DIED, "engine_failed")
            raise
        finally:
            self._fail_queued()
            self.on_exit()

    def _load_model(self) -> bool:
        opts = self._options
        try:
            loaded = self._load()
            wire_model_memory()
            if opts.kv_bits is not None:
                check_quantized_kv(loaded.config, activation_dtype(loaded.model), opts.kv_bits, opts.kv_group_size)
        except Exception as exc:
            self.load_error = str(exc) or type(exc).__name__
            log.error("model load failed: %s", self.load_error)
            self.meter.end()
            return False
        budget = opts.kv_budget_tokens or kv_budget_tokens(loaded.native_context, opts.batch, opts.max_context)
        self.kv = KvLedger(budget)
        if opts.batch >= FLATTEN_MIN_ROWS and wins_here() and (n := flatten_quantized_rows(loaded.model)):
            log.info("%d quantized layers run batched decode rows flattened (from %d rows)", n, FLATTEN_MIN_ROWS)
        if opts.batch > 1 and decode_attention.enabled() and (modules := decode_attention.install(loaded.model)):
            log.info("batched decode attention runs mlxd's kernel (%s)", ", ".join(modules))
        if wanted(opts.warmup):
            if cold := mlx_env.cold_kernel_cache(os.environ, cuda=bool(mx.cuda.is_available())):
                log.info("warm-up: the first start on this machine with this MLX version compiles its GPU kernels "
                         "(about a minute; kept in %s for later starts)", cold)
            seconds, jobs, most = self._warm_up(loaded)
            log.info("warm-up: %d jobs, up to %d rows at once: %.0f ms", jobs, most, seconds * 1000)
        # Unseeded sampling draws from MLX's global generator: fresh entropy for each engine.
        mx.random.seed(int.from_bytes(os.urandom(8), "little"))
        self.prompt_cache = PrefixCache(opts.prompt_cache_bytes, self._ssd_tier(loaded), self._idle)
        self._make_lanes(loaded, self._stats, self.prompt_cache)
        self.meter.end()
        self.loaded = loaded
        # What exists now (the model, tokenizer, kernels) lives as long as the engine: kept out of
        # the collector's full passes, which otherwise walk it all and stall a decode step.
        gc.collect()
        gc.freeze()
        log.info("batch width %d, KV budget %d tokens", opts.batch, budget)
        self.on_ready()
        return True

    def _ssd_tier(self, loaded: LoadedModel) -> SsdTier | None:
        """The SSD tier for this model and KV settings; None when off or its dir is unusable."""
        opts = self._options
        if opts.ssd_root is None or opts.ssd_cache_bytes == 0 or opts.prompt_cache_bytes == 0:
            return None
        try:
            root = tier_dir(opts.ssd_root, loaded.path, opts.kv_bits, opts.kv_group_size)
            cap = opts.ssd_cache_bytes if opts.ssd_cache_bytes is not None else default_ssd_cache_bytes(root)
            return SsdTier(root, cap)
        except OSError as exc:
            log.warning("SSD prompt cache off: cannot use %s: %s", opts.ssd_root, exc)
            return None

    def _make_lanes(self, loaded: LoadedModel, stats: Stats, cache: PrefixCache) -> None:
        opts = self._options
        self._serial = SerialLane(loaded, stats, opts.prefill_step, cache, opts.kv_bits, opts.kv_group_size)
        self._batch = BatchLane(loaded, stats, opts.prefill_step, opts.batch, cache) if opts.batch > 1 else None

    def _warm_up(self, loaded: LoadedModel) -> tuple[float, int, int]:
        """Run warmup.py's jobs through the lanes' own turns: seconds, jobs, most rows at once.

        The lanes are built for it with their own stats and prompt cache (RAM only), then built again.
        """
        started, busy = time.perf_counter(), self._stats.busy_s
        self._make_lanes(loaded, Stats(), PrefixCache(self._options.prompt_cache_bytes))
        jobs, most, level = 0, 0, log.level
        log.setLevel(logging.WARNING)  # its jobs' own lines would read as requests
        all_waves = waves(loaded.vocab_size, self._options.batch)
        self.meter.begin("warmup", sum(len(wave) for wave in all_waves))
        for wave in all_waves:
            jobs += len(wave)
            self._waiting.append(wave[0])
            self._turn(None)  # the first job of a wave starts alone
            self._waiting.extend(wave[1:])
            while self._has_work():
                self._turn(None)
                most = max(most, self._rows_running())
            self.meter.advance(len(wave))
        mx.synchronize()
        log.setLevel(level)
        self._stats.busy_s, self._bursts_until = busy, 0.0
        return time.perf_counter() - started, jobs, most

    def _rows_running(self) -> int:
        return sum(lane.num_rows for lane in (self._serial, self._batch) if lane is not None)

    def _serve(self) -> None:
        trace = StepTrace.from_env()
        while True:
            idle = not self._has_work()
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
            stop = False
            for command in received:
                if isinstance(command, Stop):
                    stop = True
                elif isinstance(command, Flush):
                    self._flush(command, skip=stop)
                else:
                    self._waiting.append(command)  # after a Stop: failed by _fail_queued
            if stop:
                return
            self._turn(trace, len(received))

    def _write_behind(self) -> str:
        """Idle: hand the SSD writer a prompt-cache entry (PrefixCache.write_behind's answer)."""
        cache = self.prompt_cache
        if cache is None or not self._options.write_behind:
            return "none"
        try:
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

    def _turn(self, trace: StepTrace | None, received: int = 0) -> None:
        """Start what fits, then step each lane once."""
        started = time.perf_counter()
        queued = len(self._waiting)
        self._admit()
        self._merge_lanes()
        ended: list[Sequence] = []
        if self._serial is not None and self._serial.has_work:
            ended += self._serial.step()
        if self._batch is not None and self._batch.has_work:
            ended += self._batch.step()
        for seq in ended:
            self._release(seq)
        if self._rows_running() + len(self._waiting) >= 2:
            self._bursts_until = time.monotonic() + BURST_MEMORY_S
        ended_at = time.perf_counter()
        self._stats.busy_s += ended_at - started  # the GPU thread's time at work
        if trace is not None:
            trace.turn(started, ended_at, received=received, admitted=queued - len(self._waiting), waiting=len(self._waiting),
                       serial=self._serial.num_rows if self._serial else 0,
                       batch=self._batch.num_rows if self._batch else 0,
                       prefilling=self._batch.num_prefilling if self._batch else 0)

    def _has_work(self) -> bool:
        return bool(self._waiting) or any(lane is not None and lane.has_work for lane in (self._serial, self._batch))

    def _in_bursts(self) -> bool:
        return self._options.gather_ms > 0 and self._options.batch > 1 and time.monotonic() < self._bursts_until

    def _gather(self, have: int) -> list[Command]:
        """The rest of a burst: wait up to gather_ms for each next arrival (4x that in all),
        until the batch width is reached, so that the burst starts as one batched prefill
        instead of its first request prefilling alone while the others wait for it."""
        gap = self._options.gather_ms / 1000
        deadline = time.monotonic() + 4 * gap
        more: list[Command] = []
        while have + len(more) < self._options.batch:
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

    def _admit(self) -> None:
        """Start waiting jobs in order while they fit; the first that does not holds the rest."""
        assert self._serial is not None and self.kv is not None
        for job in list(self._waiting):
            if job.ticket.is_cancelled or self._is_stopping:
                self._waiting.remove(job)
                self._stats.num_cancelled += 1
                job.ticket.emit(Done("cancelled", len(job.prompt), 0))
                continue
            need = kv_tokens(len(job.prompt), job.max_tokens)
            batch_rows = self._batch.num_rows if self._batch is not None else 0
            behind = len(self._waiting) - 1  # the jobs before this one have left the queue
            if job.group is not None:  # a choice of n: the batch lane prefills their prompt once
                behind = max(behind, job.group.size - 1)
            state = LaneState(self._options.batch, self._serial.has_work, batch_rows, self.kv.free, behind)
            lane = choose_lane(need, state)
            if lane is None and not self._serial.has_work and not batch_rows:
                # Nothing runs and it still does not fit: submit() refuses these, so this is a bug.
                self._waiting.remove(job)
                self._stats.num_failed += 1
                job.ticket.emit(Failed(f"The request needs {need} tokens of KV; the budget is {self.kv.budget_tokens}."))
                continue
            if lane is None:
                return
            self._waiting.remove(job)
            self.kv.book(need)
            try:
                (self._serial if lane == "serial" else self._batch).admit(job)  # type: ignore[union-attr]
            except Exception as exc:
                log.error("could not start a request:\n%s", traceback.format_exc())
                self.kv.release(need)
                self._stats.num_failed += 1
                job.ticket.emit(Failed(f"generation failed: {type(exc).__name__}: {exc}"))

    def _merge_lanes(self) -> None:
        """While rows decode in the batch, the serial lane's sequence joins them: one forward
        pass a step for all, instead of the serial lane's and the batch's one after the other."""
        if self._batch is None or self._serial is None or not (self._serial.has_work and self._batch.has_work):
            return
        moved = None
        try:
            moved = self._serial.hand_over()
            if moved is not None:
                self._batch.adopt(*moved)
        except Exception as exc:
            log.error("moving a request into the batch failed:\n%s", traceback.format_exc())
            message = f"generation failed: {type(exc).__name__}: {exc}"
            if moved is None:
                failed = self._serial.fail_all(message, "generation_failed")
            else:
                moved[0].fail(self._stats, message)
                failed = [moved[0]]
            for seq in failed:
                self._release(seq)

    def _release(self, seq: Sequence) -> None:
        assert self.kv is not None
        self.kv.release(kv_tokens(len(seq.job.prompt), seq.job.max_tokens))

    def _fail_running(self, message: str, code: str) -> None:
        for lane in (self._serial, self._batch):
            if lane is not None:
                lane.fail_all(message, code)

    def _fail_queued(self) -> None:
        # Whatever waits or is still in the inbox when the thread ends would otherwise wait forever.
        for job in self._waiting:
            job.ticket.emit(STOPPING)
        self._waiting.clear()
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Job):
                command.ticket.emit(STOPPING)
            elif isinstance(command, Flush):
                answer(command.done, FlushReport(complete=False))
