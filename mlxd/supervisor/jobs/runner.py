"""Running lab jobs: one at a time, each in a worker process of its own, holding the machine.

A job waits in the store's queue. Its turn comes when the job before it ended. Jobs that load
a model (a fine-tune, a quantization) first take a machine lease through the pool (leases.py;
`mlxd ps` shows it): every engine drains and stops, and requests wait in the pool's queue until
the job ends (up to `[pool] queue_timeout_s`, then a 503), so serving and a job never both hold a
model's memory. The worker (`python -m mlxd.lab JOB_DIR`) runs in a session of its own, its
output going to the job's log; its reports come as lines of JOB_DIR/events.jsonl, which the
runner follows into the store and to whoever streams the job.

A supervisor that starts finds the jobs the store says are running: a worker that still lives is
adopted (its events followed, its lease taken again, its end read from its events); one that
is gone is marked failed, saying so. Cancelling sends the worker's session SIGTERM, then
SIGKILL after CANCEL_GRACE_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import psutil

from mlxd.protocol.errors import APIError
from mlxd.protocol.jobs import FINISHED, Failure, Job, Made, Progress, WorkerJob, worker_line
from mlxd.supervisor.engines.leases import Leases
from mlxd.supervisor.jobs.store import JobStore

log = logging.getLogger("mlxd.supervisor")
JOB_FILE, EVENTS_FILE = "job.json", "events.jsonl"
FOLLOW_EVERY_S = 0.2
LEASE_TTL_S = 60.0
CANCEL_GRACE_S = 10.0
NEEDS_MACHINE = frozenset({"finetune", "quantize", "fuse"})  # a merge reads adapters only
WORKER_ENV = {**os.environ, "NO_COLOR": "1", "TERM": "dumb"}  # a log file, not a terminal: no colours


class JobRunner:
    """The queue of lab jobs and the one running (loop thread only)."""

    def __init__(self, store: JobStore, leases: Leases | None, on_made: Callable[[Made], None] = lambda m: None,
                 secrets: Callable[[Job], dict[str, str]] = lambda job: {}) -> None:
        self.store = store
        self._secrets = secrets  # a job's keys and tokens: given in its worker's environment only
        self._leases = leases
        self._on_made = on_made  # a finished job's output: rescan what can be served
        self._wake = asyncio.Event()
        self._changed = asyncio.Condition()
        self._cancelled: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._running: str | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """At shutdown: the running worker keeps running (the next supervisor adopts it)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def submit(self, kind: str, request: dict[str, object], worker: Callable[[str], WorkerJob]) -> Job:
        """Queue a job (`worker(id)` says what its worker gets); its record, queued."""
        job = self.store.create(kind, request)
        (self.store.dir_of(job.id) / JOB_FILE).write_bytes(msgspec.json.encode(worker(job.id)))
        self._wake.set()
        return job

    async def cancel(self, job_id: str) -> Job:
        job = self.store.get(job_id)
        if job is None:
            raise not_found(job_id)
        if job.state == "queued":
            self.store.finished(job_id, "cancelled", "cancelled before it started")
        elif job.state == "running" and job.pid is not None:
            self._cancelled.add(job_id)
            pid, job_dir = job.pid, self.store.dir_of(job_id)
            _signal(pid, signal.SIGTERM)
            asyncio.get_running_loop().call_later(CANCEL_GRACE_S, _kill_if_worker, pid, job_dir)
        await self._notify()
        found = self.store.get(job_id)
        assert found is not None
        return found

    async def changes(self, job_id: str, timeout_s: float) -> Job | None:
        """The job after its next change, or as it is once `timeout_s` passed."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout_s)
        return self.store.get(job_id)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _loop(self) -> None:
        for job in self.store.in_state("running"):
            await self._recover(job)
        while True:
            queued = self.store.in_state("queued")
            if not queued:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._run(queued[0])
            except Exception:
                log.exception("job %s: the runner failed", queued[0].id)
                self.store.finished(queued[0].id, "failed", "mlxd could not run the job (see the supervisor's log)")
                await self._notify()

    async def _recover(self, job: Job) -> None:
        if job.pid is not None and _is_worker(job.pid, self.store.dir_of(job.id)):
            log.info("job %s: adopting its worker (pid %d)", job.id, job.pid)
            async with self._machine(job):
                await self._follow(job.id, job.pid, None)
            return
        self.store.finished(job.id, "failed", "the supervisor stopped while the job ran, and its worker is gone")
        log.warning("job %s: marked failed: its worker is gone", job.id)

    async def _run(self, job: Job) -> None:
        async with self._machine(job):
            if self.store.get(job.id) is None or job.id in self._cancelled:
                return
            job_dir = self.store.dir_of(job.id)
            with (job_dir / "log.txt").open("ab") as log_file:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "mlxd.lab", str(job_dir), stdin=asyncio.subprocess.DEVNULL,
                    stdout=log_file, stderr=log_file, start_new_session=True, env={**WORKER_ENV, **self._secrets(job)})
            self.store.started(job.id, proc.pid)
            log.info("job %s (%s) started: pid %d", job.id, job.kind, proc.pid)
            await self._notify()
            await self._follow(job.id, proc.pid, proc)

    @contextlib.asynccontextmanager
    async def _machine(self, job: Job) -> AsyncIterator[None]:
        """The machine lease a job that loads a model holds while it runs (renewed meanwhile)."""
        if self._leases is None or job.kind not in NEEDS_MACHINE:
            yield
            return
        lease = await self._leases.take(None, LEASE_TTL_S, f"mlxd job {job.id} ({job.kind})")
        renew = asyncio.create_task(self._renew(lease.id))
        try:
            yield
        finally:
            renew.cancel()
            with contextlib.suppress(APIError):
                self._leases.end(lease.id, "job ended")

    async def _renew(self, lease_id: str) -> None:
        assert self._leases is not None
        while True:
            await asyncio.sleep(LEASE_TTL_S / 3)
            with contextlib.suppress(APIError):
                self._leases.renew(lease_id, LEASE_TTL_S)

    async def _follow(self, job_id: str, pid: int, proc: asyncio.subprocess.Process | None) -> None:
        """Read the job's events into the store until its worker ended; then its end."""
        self._running = job_id
        events = self.store.dir_of(job_id) / EVENTS_FILE
        offset, made, failure, code = 0, None, None, None
        try:
            while True:
                if proc is not None:
                    with contextlib.suppress(TimeoutError):
                        code = await asyncio.wait_for(proc.wait(), FOLLOW_EVERY_S)
                else:
                    await asyncio.sleep(FOLLOW_EVERY_S)
                    code = None if _is_alive(pid) else -1
                offset, lines = _read_lines(events, offset)
                for line in lines:
                    if isinstance(line, Progress):
                        self.store.progressed(job_id, line)
                    elif isinstance(line, Made):
                        made = line
                    else:
                        failure = line
                if lines:
                    await self._notify()
                if code is not None:
                    break
        finally:
            self._running = None
        self._end(job_id, code, made, failure)
        await self._notify()

    def _end(self, job_id: str, code: int | None, made: Made | None, failure: Failure | None) -> None:
        if job_id in self._cancelled:
            self._cancelled.discard(job_id)
            self.store.finished(job_id, "cancelled", "cancelled")
        elif made is not None and code in (0, -1):
            self.store.finished(job_id, "succeeded", result=made)
            self._on_made(made)
        else:
            why = failure.error if failure is not None else f"the worker ended (exit {code}) without a result; see its log"
            self.store.finished(job_id, "failed", why)
        job = self.store.get(job_id)
        log.info("job %s %s%s", job_id, job.state if job else "?", f": {job.error}" if job and job.error else "")

    def is_finished(self, job: Job) -> bool:
        return job.state in FINISHED


def not_found(job_id: str) -> APIError:
    return APIError(404, f"No job {job_id[:100]!r}.", param="id", code="job_not_found")


def _read_lines(path: Path, offset: int) -> tuple[int, list[Progress | Made | Failure]]:
    """The whole lines written to `path` past `offset`, decoded (a bad one is skipped)."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset, []
    end = data.rfind(b"\n") + 1
    out = []
    for raw in data[:end].splitlines():
        with contextlib.suppress(msgspec.DecodeError):
            out.append(worker_line.decode(raw))
    return offset + end, out


def _is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _is_worker(pid: int, job_dir: Path) -> bool:
    """Whether `pid` is this job's worker (not a process that took its pid since)."""
    try:
        return _is_alive(pid) and str(job_dir) in psutil.Process(pid).cmdline()
    except psutil.Error:
        return False


def _kill_if_worker(pid: int, job_dir: Path) -> None:
    """SIGKILL a cancelled worker that outlived its grace (if that pid is still it)."""
    if _is_worker(pid, job_dir):
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)  # its session: the worker and anything it started
