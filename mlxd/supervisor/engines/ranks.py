"""The ranks past 0 of a model's engine group (docs/distributed.md): started beside rank 0, the
engine the pool sees, and killed with it. A rank that dies ends the group: rank 0 notices on its
control socket and exits, and the engine's owner restarts all of them as one engine."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import sys
from pathlib import Path

from mlxd.protocol.group import GroupSpec, free_port, rank_env, write_hostfile

log = logging.getLogger("mlxd.supervisor")


class Ranks:
    def __init__(self, model_id: str, spec: GroupSpec, runtime_dir: Path) -> None:
        self.model_id = model_id
        self.spec = spec
        name = hashlib.sha256(model_id.encode()).hexdigest()[:12]
        self.control = runtime_dir / f"g-{name}.sock"  # rank 0 listens, the others connect
        self._hostfile = runtime_dir / f"g-{name}.json"
        self._nccl_port = 0
        self._procs: list[asyncio.subprocess.Process] = []
        self._logs: list[asyncio.Task[None]] = []

    def env(self, rank: int) -> dict[str, str]:
        """Rank `rank`'s mx.distributed variables (after `prepare`)."""
        return rank_env(self.spec, self._hostfile, self._nccl_port, rank)

    def prepare(self) -> None:
        """Fresh addresses for a new start of the group."""
        write_hostfile(self._hostfile, self.spec.ranks)
        self._nccl_port = free_port()

    async def start(self, module: str, argv: list[str], env: dict[str, str]) -> None:
        """Ranks 1..N-1 with rank 0's command line."""
        for rank in range(1, self.spec.ranks):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", module, *argv, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **env, **self.env(rank), "MLXD_PARENT_PID": str(os.getpid())})
            self._procs.append(proc)
            assert proc.stdout is not None
            self._logs.append(asyncio.create_task(self._relay(rank, proc.stdout)))
            log.info("[%s] rank %d pid %d starting", self.model_id, rank, proc.pid)

    async def kill(self) -> None:
        """End every rank past 0 now: a rank waiting in a collective heeds only SIGKILL."""
        procs, self._procs = self._procs, []
        for proc in procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for proc in procs:
            await proc.wait()
        for task in self._logs:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._logs = []

    async def _relay(self, rank: int, stream: asyncio.StreamReader) -> None:
        from mlxd.supervisor.engines.engine import TIMESTAMP

        async for raw in stream:  # ours is added again
            log.info("[%s rank %d] %s", self.model_id, rank, TIMESTAMP.sub("", raw.decode(errors="replace").rstrip()))
