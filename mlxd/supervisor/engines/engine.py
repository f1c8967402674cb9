"""One engine child per model: spawn, health, crash detection, restart backoff and cool-down.

One asyncio task (the owner) runs each spawned engine from start to exit, and a failed one
through its cool-down, and is the only code that changes its state; callers
`await engine.ensure_ready()`. What a crash leads to is decided in `policy` (crash loops).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import msgspec

from mlxd.protocol.engine_state import EngineState
from mlxd.protocol.errors import APIError
from mlxd.protocol.exit_codes import ExitCode
from mlxd.protocol.group import GroupSpec
from mlxd.protocol.process import DRAIN_PATH, HEALTH_PATH, STATS_PATH, DrainRequest, DrainResult
from mlxd.protocol.sampling import Defaults
from mlxd.protocol.stats import EngineHealth, EngineView, LaneStats, LoadProgress, PromptCacheStats
from mlxd.supervisor.engines import policy
from mlxd.supervisor.engines.ranks import Ranks
from mlxd.supervisor.engines.spare import Spare
from mlxd.supervisor.engines.upstream import UpstreamError, call, connection_gate

log = logging.getLogger("mlxd.supervisor")


@dataclass(frozen=True)
class EngineOptions:
    """How engines are run and watched. The env knobs exist for tests and tuning."""

    module: str = "mlxd.engine"  # what `python -m` runs (tests point it at a fake engine)
    boot_timeout_s: float = 300.0
    grace_s: float = 5.0  # SIGTERM -> SIGKILL
    health_every_s: float = 5.0
    health_deadline_s: float = 30.0  # unanswered health checks this long: killed as hung
    backoff_base_s: float = 1.0
    crash: policy.CrashLimits = field(default_factory=policy.CrashLimits)  # [pool] crash-loop keys (the pool sets them)
    engine_args: tuple[str, ...] = ()  # flags every engine gets from [pool] (the pool sets them)
    engine_env: tuple[tuple[str, str], ...] = ()  # environment every engine (and the spare) gets from [pool]

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> EngineOptions:
        """Defaults, overridden by MLXD_ENGINE_MODULE / _HEALTH_EVERY_S / _HEALTH_DEADLINE_S / _BACKOFF_S."""
        return cls(
            module=env.get("MLXD_ENGINE_MODULE", cls.module),
            health_every_s=float(env.get("MLXD_ENGINE_HEALTH_EVERY_S", cls.health_every_s)),
            health_deadline_s=float(env.get("MLXD_ENGINE_HEALTH_DEADLINE_S", cls.health_deadline_s)),
            backoff_base_s=float(env.get("MLXD_ENGINE_BACKOFF_S", cls.backoff_base_s)),
        )
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
BOOT_POLL_S = 0.01  # /health polls while an engine starts (a swap waits on this)
LOST_POLL_S = 0.05  # a request that found the engine's socket refusing looks this often for its exit
NO_RETRY = {ExitCode.ENGINE_BOOT_ERROR, ExitCode.MODEL_LOAD_ERROR, 2}


def socket_path(runtime_dir: Path, model_id: str) -> Path:
    """A short, stable socket path per model (Unix socket paths are limited to ~100 bytes)."""
    return runtime_dir / f"e-{hashlib.sha256(model_id.encode()).hexdigest()[:12]}.sock"


@dataclass
class _Drain:
    """Owner command: drain the engine, then serve again (`resume`) or stop it."""

    timeout_s: float
    resume: bool
    done: asyncio.Future[DrainResult | None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Engine:
    """The engine child for one model (talked to over its socket with upstream.py's client).

    33 methods, past the house's ~25, on purpose: most are the steps of the one owner
    task (spawn, boot, watch, drain, cool down) that is the only writer of `state`. Split
    across classes, that single writer would be spread over several.
    """

    def __init__(
        self, model_id: str, model_dir: Path, runtime_dir: Path, max_context: int | None = None,
        options: EngineOptions | None = None, *, batch: int | None = 1, memory_bytes: int | None = None,
        draft: tuple[str | None, int | None] = (None, None), defaults: Defaults | None = None,
        group: GroupSpec | None = None,
    ) -> None:
        self.options = options or EngineOptions()
        self.model_id = model_id
        self.model_dir = model_dir
        self.socket = socket_path(runtime_dir, model_id)
        self.connections = connection_gate()  # requests connected to it at once (upstream.py)
        self.max_context = max_context
        self.batch = batch  # sequences the engine decodes at once (`--batch`; None: auto)
        self.memory_bytes = memory_bytes  # what it may size itself within (`--memory-bytes`; None: the device's)
        self.draft = draft  # its model's own draft and draft length ([models.NAME]; None: the pool's flags)
        self.defaults = defaults  # what its requests get when they set none (the config's; --defaults)
        self.lanes: LaneStats | None = None  # its /admin/stats `lanes` (the width and KV budget it chose)
        self.ranks = Ranks(model_id, group, runtime_dir) if group is not None else None  # an engine group's others
        self.state = EngineState.STOPPED
        self.on_change: Callable[[], None] = lambda: None  # after every state change (the pool replans)
        self.ready_since: float | None = None  # wall time it last became READY
        self._commands: asyncio.Queue[_Drain] = asyncio.Queue()
        self.pid: int | None = None
        self.failure: str | None = None
        self.boot_error: APIError | None = None  # the last failed start, as its waiters are told
        self.spare: Spare | None = None  # the pool's pre-started engine process, if it keeps one
        self.boot_timings: dict[str, float] = {}  # spawn_ms (until it answers), load_ms (until ready)
        self.stop_timings: dict[str, float] = {}  # drain_ms, stop_ms (SIGTERM to exit) of the last retire
        self._spawned_at = 0.0
        self.num_restarts = 0
        self._history = policy.CrashHistory()
        self._ready_at: float | None = None  # monotonic: when this run became READY
        self.retry_at: float | None = None  # monotonic: when a FAILED engine may start again
        self._retry_now: asyncio.Event | None = None  # set while FAILED: an admin load ends the cool-down
        self._owner: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None
        self._stop_requested = False
        self._log_tail: collections.deque[str] = collections.deque(maxlen=40)
        self._log_task: asyncio.Task[None] | None = None
        self.prompt_cache: PromptCacheStats | None = None  # its /admin/stats `prompt_cache`, as last fetched
        self._load: LoadProgress | None = None  # while it starts: its /health `load`, as last polled

    async def fetch_stats(self) -> None:
        """The engine's prompt-cache figures (RAM and SSD tiers) and lanes (the width and KV budget
        it chose), fresh; None unless it serves."""
        if self.state not in (EngineState.READY, EngineState.DRAINING):
            self.prompt_cache = self.lanes = None
            return
        try:
            status, data = await call(self.socket, "GET", STATS_PATH)
            if status == 200:
                view = msgspec.json.decode(data, type=EngineView)
                self.prompt_cache, self.lanes = view.prompt_cache, view.lanes
        except (TimeoutError, OSError, UpstreamError):
            pass  # keep the last figures: a busy engine answers next time
        except msgspec.DecodeError as exc:
            log.warning("[%s] the engine's /admin/stats did not decode: %s", self.model_id, exc)

    def load_progress(self) -> LoadProgress | None:
        """How far a starting engine has got (None unless it starts), timed from its spawn."""
        if self.state is not EngineState.STARTING or self._load is None:
            return None
        elapsed = round(time.perf_counter() - self._spawned_at, 3)
        return msgspec.structs.replace(self._load, elapsed_s=elapsed)

    async def ensure_ready(self) -> None:
        """Start the engine if it is not running, and wait until it answers `ready`."""
        if self.state is EngineState.FAILED:
            raise self.failed_error()
        self.start()
        assert self._ready is not None
        await asyncio.shield(self._ready)

    async def lost(self, pid: int | None) -> None:
        """Wait until the run `pid` is over, once its socket refused a connection: the process is
        dead or dying, and a GPU process killed with its device memory in use takes a while to
        exit after its sockets closed (its driver tears the context down). Returns at once when
        another run serves, when its socket takes a connection again (the refusal was passing),
        and once the health check's deadline (and a kill's grace) has gone by."""
        deadline = time.monotonic() + self.options.health_deadline_s + self.options.grace_s
        while self.pid == pid and self.state is EngineState.READY and time.monotonic() < deadline:
            await asyncio.sleep(LOST_POLL_S)
            try:
                _, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(self.socket)), LOST_POLL_S * 10)
            except (OSError, TimeoutError):
                continue
            writer.close()
            return

    def start(self) -> None:
        """Start the owner task unless it runs (it waits out the restart backoff first)."""
        if self.state is EngineState.FAILED or (self._owner is not None and not self._owner.done()):
            return
        self._stop_requested = False
        self._ready = asyncio.get_running_loop().create_future()
        self._ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # read by ensure_ready, maybe never
        self._commands = asyncio.Queue()
        self._set(EngineState.STARTING)
        self._owner = asyncio.create_task(self._own(), name=f"engine:{self.model_id}")

    async def reset(self) -> None:
        """An admin load: a FAILED model may start now, its past crashes forgotten."""
        if self._retry_now is not None and self._owner is not None:
            self._retry_now.set()
            await asyncio.shield(self._owner)  # it ends the cool-down: STOPPED

    def retry_in_s(self) -> float | None:
        """Seconds until a FAILED engine starts again by itself; None unless failed."""
        if self.state is not EngineState.FAILED or self.retry_at is None:
            return None
        return max(0.0, self.retry_at - time.monotonic())

    def failed_error(self) -> APIError:
        """What a request for a FAILED model gets: 503, with Retry-After until its next try."""
        retry_after = policy.retry_after_s(self.retry_in_s() or 0.0)
        return APIError(503, f"Model {self.model_id} failed: {self.failure} (trying again in {retry_after} s)",
                        type="server_error", code="model_failed", headers={"Retry-After": str(retry_after)})

    async def drain(self, timeout_s: float) -> DrainResult | None:
        """Drain a READY engine and let it serve again; the engine's report, None if not running."""
        return await self._command(_Drain(timeout_s, resume=True))

    async def retire(self, timeout_s: float) -> DrainResult | None:
        """Drain, then stop (SIGTERM, SIGKILL after the grace period); the drain report."""
        # This owner's end: once it reports STOPPED, a replan may start the next engine, whose
        # owner must not be waited for here (test_unload_racing_requests_never_stalls_the_model).
        owner = self._owner
        report = await self._command(_Drain(timeout_s, resume=False))
        if owner is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(owner)
        return report

    async def _command(self, command: _Drain) -> DrainResult | None:
        if self._owner is None or self._owner.done() or self._retry_now is not None:
            return None  # no engine runs (a cooling owner takes no commands)
        self._commands.put_nowait(command)
        return await asyncio.shield(command.done)

    def _set(self, state: EngineState) -> None:
        self.state = state
        if state is EngineState.READY:
            self.ready_since = time.time()
        self.on_change()

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after the grace period; wait for the owner task to finish."""
        self._stop_requested = True
        if self._owner is not None and not self._owner.done():
            self._owner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._owner

    async def _own(self) -> None:
        await self._run()
        if self.state is EngineState.FAILED:
            await self._cool_down()

    async def _run(self) -> None:
        """One engine process, from the restart back-off to its exit."""
        proc: asyncio.subprocess.Process | None = None
        try:
            await asyncio.sleep(self._restart_delay_s())
            proc = await self._spawn()
            await self._boot(proc)
            self.failure = self.boot_error = None  # what a request is told is the latest news
            self._ready_at = time.monotonic()
            self._set(EngineState.READY)
            self._resolve_ready(None)
            code = await self._watch(proc)
            self._end_spell()
            if code is not None:
                self._on_exit(code)
        except asyncio.CancelledError:
            self._end_spell()
            self._set(EngineState.STOPPING)
            if proc is not None:
                await kill_engine(proc, self.options.grace_s)
            self._set(EngineState.STOPPED)
        except APIError as err:
            self._resolve_ready(err)
        finally:
            if self.ranks is not None:  # no rank outlives rank 0
                await self.ranks.kill()
            self._resolve_ready(APIError(503, "The engine is stopping.", type="server_error", code="engine_stopping"))
            self._finish_commands()
            self.pid = None
            self.on_change()

    def argv(self) -> list[str]:
        """The engine's command line after `python -m MODULE` (a spare is given the same)."""
        args = ["--model", str(self.model_dir), "--model-id", self.model_id, "--socket", str(self.socket),
                "--parent-pid", str(os.getpid()), "--batch", "auto" if self.batch is None else str(self.batch)]
        if self.memory_bytes is not None:
            args += ["--memory-bytes", str(self.memory_bytes)]
        if self.max_context:
            args += ["--max-context", str(self.max_context)]
        args += self.options.engine_args
        kind, length = self.draft  # the model's own settings after the pool's: the last flag wins
        if kind is not None:
            args += ["--draft", kind]
        if length is not None:
            args += ["--num-draft-tokens", str(length)]
        if self.defaults is not None and not self.defaults.is_empty:
            args += ["--defaults", msgspec.json.encode(self.defaults).decode()]
        if self.ranks is not None:
            args += self.ranks.spec.flags(self.ranks.control)
        return args

    async def _spawn(self) -> asyncio.subprocess.Process:
        """A spare process given this model, else a new one."""
        self.boot_timings = {}
        self._spawned_at = time.perf_counter()
        self._load = LoadProgress("spawn")
        if self.ranks is not None and (failed := await self.ranks.prepare()) is not None:
            self._fail_boot(failed, can_retry=True)  # another host's agent: unreachable, or refused us
        args, env = self.argv(), dict(self.options.engine_env)
        if self.ranks is not None:
            env.update(self.ranks.env(0))
        proc = await self.spare.take(args) if self.spare is not None and self.ranks is None else None
        how = "from the spare" if proc is not None else "spawned"
        if proc is None:
            # Our pid, named: an engine that only starts reading its parent after we died (a
            # SIGKILL right after the spawn, a slow start under load) would take init for it
            # and outlive us. With it, the engine sees at start that we are gone, and exits.
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", self.options.module, *args,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **env, "MLXD_PARENT_PID": str(os.getpid())},
            )
            if self.ranks is not None and (failed := await self.ranks.start(self.options.module, args,
                                                                           dict(self.options.engine_env))):
                await kill_engine(proc, 0.0)
                self._fail_boot(failed, can_retry=True)
        self.pid = proc.pid
        assert proc.stdout is not None
        self._log_task = asyncio.create_task(self._relay_log(proc.stdout))
        log.info("[%s] engine pid %d starting (%s)", self.model_id, proc.pid, how)
        return proc

    async def _relay_log(self, stream: asyncio.StreamReader) -> None:
        async for raw in stream:
            line = TIMESTAMP.sub("", raw.decode(errors="replace").rstrip())  # ours is added again
            self._log_tail.append(line)
            log.info("[%s] %s", self.model_id, line)

    async def _boot(self, proc: asyncio.subprocess.Process) -> None:
        """Wait for `/health` to say ready; a boot failure is a clear error, not a restart storm."""
        deadline = time.monotonic() + self.options.boot_timeout_s
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                break
            health = await self._health()
            if health is not None and "spawn_ms" not in self.boot_timings:
                self.boot_timings["spawn_ms"] = self._ms_since_spawn()  # answering: imports done
            if health is not None and health.load is not None:
                self._load = health.load
            if health is not None and health.status == "ready":
                self.boot_timings["load_ms"] = self._ms_since_spawn() - self.boot_timings["spawn_ms"]
                self._load = None
                return
            await asyncio.sleep(BOOT_POLL_S)
        code = await _wait_code(proc, 1.0)
        if code is None:
            await kill_engine(proc, 0.5)
        self._fail_boot(self._boot_failure(code), can_retry=code not in NO_RETRY)

    def _fail_boot(self, reason: str, can_retry: bool) -> NoReturn:
        log.error("[%s] engine failed to start: %s", self.model_id, reason)
        retry_after = policy.retry_after_s(self._record_crash(reason, can_retry=can_retry) or 0.0)
        self.boot_error = APIError(503, f"Model {self.model_id} could not be loaded: {reason}", type="server_error",
                                   code="model_load_failed", headers={"Retry-After": str(retry_after)})
        raise self.boot_error

    def _ms_since_spawn(self) -> float:
        return round((time.perf_counter() - self._spawned_at) * 1000, 1)

    def _boot_failure(self, code: int | None) -> str:
        last = next((line for line in reversed(self._log_tail) if "ERROR" in line), None)
        detail = last.split(": ", 1)[-1] if last else f"exit code {code}"
        return detail if code is not None else f"no ready answer within {self.options.boot_timeout_s:.0f} s"

    async def _health(self) -> EngineHealth | None:
        try:
            _, data = await call(self.socket, "GET", HEALTH_PATH)
            return msgspec.json.decode(data, type=EngineHealth)
        except (TimeoutError, OSError, UpstreamError, msgspec.DecodeError):
            return None

    async def _watch(self, proc: asyncio.subprocess.Process) -> int | None:
        """Run drain commands until the engine exits (its code) or is retired (None).

        An engine whose `/health` stops answering for 30 s is killed as hung.
        """
        last_ok = time.monotonic()
        while True:
            command = await self._next_command(proc)
            if proc.returncode is not None:
                if command is not None:
                    self._commands.put_nowait(command)  # answered as the owner ends
                return proc.returncode
            if command is not None:
                if await self._run_drain(proc, command):
                    return None
                last_ok = time.monotonic()
                continue
            if await self._health() is not None:
                last_ok = time.monotonic()
            elif time.monotonic() - last_ok > self.options.health_deadline_s:
                log.error("[%s] engine stopped answering its health check; killing it", self.model_id)
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGABRT)
                return await _wait_code(proc, 2.0) or await kill_engine(proc, 0.0)

    async def _next_command(self, proc: asyncio.subprocess.Process) -> _Drain | None:
        """The next command, or None once the engine exits or a health check is due."""
        get = asyncio.ensure_future(self._commands.get())
        exited = asyncio.ensure_future(proc.wait())
        await asyncio.wait({get, exited}, timeout=self.options.health_every_s, return_when=asyncio.FIRST_COMPLETED)
        exited.cancel()
        if get.done():
            return get.result()
        get.cancel()
        return None

    async def _run_drain(self, proc: asyncio.subprocess.Process, command: _Drain) -> bool:
        """DRAINING, POST /admin/drain; then READY again, or stopped (True)."""
        self._set(EngineState.DRAINING)
        started = time.perf_counter()
        report = await self._post_drain(command.timeout_s, command.resume)
        drained = time.perf_counter()
        if command.resume and proc.returncode is None:
            self._set(EngineState.READY)
            command.done.set_result(report)
            return False
        self._set(EngineState.STOPPING)
        await kill_engine(proc, self.options.grace_s)
        self.stop_timings = {"drain_ms": _ms(drained - started), "stop_ms": _ms(time.perf_counter() - drained)}
        self._set(EngineState.STOPPED)
        command.done.set_result(report)
        return True

    async def _post_drain(self, timeout_s: float, resume: bool) -> DrainResult | None:
        """The engine's drain report; None when it has no drain endpoint or does not answer."""
        body = msgspec.json.encode(DrainRequest(timeout_s, resume))
        try:
            status, data = await call(self.socket, "POST", DRAIN_PATH, body, timeout_s=timeout_s + 10)
            if status != 200:
                log.warning("[%s] drain answered HTTP %d", self.model_id, status)
                return None
            return msgspec.json.decode(data, type=DrainResult)
        except (TimeoutError, OSError, UpstreamError, msgspec.DecodeError) as exc:
            log.warning("[%s] drain failed: %s", self.model_id, exc or type(exc).__name__)
            return None

    def _finish_commands(self) -> None:
        while not self._commands.empty():
            command = self._commands.get_nowait()
            if not command.done.done():
                command.done.set_result(None)

    def _on_exit(self, code: int) -> None:
        self.num_restarts += 1
        tail = " | ".join(list(self._log_tail)[-5:])
        log.error("[%s] engine exited with %s; last lines: %s", self.model_id, code, tail)
        limits = self.options.crash
        self._record_crash(f"crashed {limits.limit} times within {limits.window_s:g} s (last exit code {code})")

    def _record_crash(self, failure: str, can_retry: bool = True) -> float | None:
        """Count a crash or failed start: STOPPED (restarted on demand), or FAILED for a cool-down (its length)."""
        now = time.monotonic()
        self._history, cooldown = policy.after_crash(self._history, now, self.options.crash, can_retry)
        if cooldown is None:
            self._set(EngineState.STOPPED)
            return None
        self.failure, self.retry_at = failure, now + cooldown
        log.error("[%s] failed (%s); trying again in %g s", self.model_id, failure, cooldown)
        self._set(EngineState.FAILED)
        return cooldown

    async def _cool_down(self) -> None:
        """FAILED until the cool-down ends (or an admin load ends it), then STOPPED: startable again."""
        assert self.retry_at is not None
        self._retry_now = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._retry_now.wait(), max(0.0, self.retry_at - time.monotonic()))
        if self._retry_now.is_set():
            self._history = policy.CrashHistory()
            self.failure = self.boot_error = None
        self._retry_now, self.retry_at = None, None
        log.info("[%s] cool-down over: the model may start again", self.model_id)
        self._set(EngineState.STOPPED)

    def _restart_delay_s(self) -> float:
        return policy.restart_delay_s(self._history, time.monotonic(), self.options.crash, self.options.backoff_base_s)

    def _end_spell(self) -> None:
        """The engine stops serving: a healthy spell (policy.forget_if_healthy) forgets past crashes."""
        if self._ready_at is not None:
            served_s, self._ready_at = time.monotonic() - self._ready_at, None
            self._history = policy.forget_if_healthy(self._history, served_s, self.options.crash)

    def _resolve_ready(self, err: APIError | None) -> None:
        if self._ready is not None and not self._ready.done():
            if err is None:
                self._ready.set_result(None)
            else:
                self._ready.set_exception(err)

def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


async def _wait_code(proc: asyncio.subprocess.Process, timeout: float) -> int | None:
    try:
        return await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        return None


async def kill_engine(proc: asyncio.subprocess.Process, grace_s: float) -> int:
    """SIGTERM, wait `grace_s`, then SIGKILL; return the exit code."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        if await _wait_code(proc, grace_s) is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    return await proc.wait()
