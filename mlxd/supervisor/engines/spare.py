"""A spare engine: one engine process started ahead of need, its imports done, waiting for a model.

Starting an engine is mostly Python imports (mlx, mlx-lm, tokenizers: about 2.5 s on a small
CPU, still hundreds of ms on a Mac). The pool keeps one such process ready; a new engine takes
it and sends it its command line on stdin, so starting a model costs only loading its weights.
The spare is made again once no engine is starting (so it never competes with a load).
A spare that dies while it waits is reaped at once and made again, later each time one dies
young (`policy.spare_delay_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from mlxd.protocol.process import SPARE_FLAG

log = logging.getLogger("mlxd.supervisor")
YOUNG_S = 10.0  # a spare that dies sooner after its start may die at once again: back off


class Spare:
    """At most one pre-started engine process."""

    def __init__(
        self, module: str, enabled: bool, on_exit: Callable[[], None] = lambda: None, env: Mapping[str, str] | None = None,
    ) -> None:
        self._module = module
        self._env = dict(env or {})  # on top of ours: what [pool] sets for every engine
        self.enabled = enabled
        self.on_exit = on_exit  # the waiting spare died and was reaped (the pool makes another)
        self._proc: asyncio.subprocess.Process | None = None
        self._starting: asyncio.Task[None] | None = None
        self._warming: asyncio.Task[None] | None = None
        self._watching: asyncio.Task[None] | None = None
        self._spawned_at = 0.0
        self.is_warm = False  # its imports are done
        self.num_young_deaths = 0  # spares in a row that died within YOUNG_S of their start

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def refill(self) -> None:
        """Start a spare unless there is one (or one is starting)."""
        if not self.enabled or self._proc is not None or self._starting is not None:
            return
        self._starting = asyncio.create_task(self._spawn(), name="spare-engine")

    async def take(self, argv: Sequence[str]) -> asyncio.subprocess.Process | None:
        """Hand the spare its command line; the process, or None when there is no live spare."""
        proc, self._proc = self._proc, None
        self._stop_warming()
        self._stop_watching()  # the engine's owner watches it from here on
        if proc is None or proc.returncode is not None or proc.stdin is None:
            return None
        self.num_young_deaths = 0
        try:
            proc.stdin.write(json.dumps(list(argv)).encode() + b"\n")
            await proc.stdin.drain()
            proc.stdin.close()
        except (ConnectionError, OSError):
            await _reap(proc)
            return None
        return proc

    async def stop(self) -> None:
        """Kill the spare (it holds no work)."""
        if self._starting is not None:
            self._starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._starting
        self._stop_warming()
        self._stop_watching()
        proc, self._proc = self._proc, None
        if proc is not None:
            await _reap(proc)

    async def _spawn(self) -> None:
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", self._module, SPARE_FLAG,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **self._env, "MLXD_PARENT_PID": str(os.getpid())},
            )
            log.debug("spare engine pid %d started", self._proc.pid)
            self._spawned_at = time.monotonic()
            self._warming = asyncio.create_task(self._wait_warm(self._proc))
            self._watching = asyncio.create_task(self._watch(self._proc))
        except OSError as exc:
            self.num_young_deaths += 1
            log.warning("cannot start a spare engine: %s", exc)
        finally:
            self._starting = None

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        """Reap the spare if it dies while it waits: no dead pid is shown or handed out."""
        code = await proc.wait()
        self._watching = None
        lived_s = time.monotonic() - self._spawned_at
        self.num_young_deaths = self.num_young_deaths + 1 if lived_s < YOUNG_S else 0
        self._proc = None
        self._stop_warming()
        if proc.stdin is not None:
            proc.stdin.close()
        log.warning("spare engine pid %d exited with %s after %.1f s", proc.pid, code, lived_s)
        self.on_exit()

    def _stop_watching(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            self._watching = None

    async def _wait_warm(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        line = await proc.stdout.readline()  # the spare's one line: its imports are done
        self.is_warm = bool(line)

    def _stop_warming(self) -> None:
        self.is_warm = False
        if self._warming is not None:
            self._warming.cancel()  # the engine's log relay reads stdout from here on
            self._warming = None


async def _reap(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    await proc.wait()
