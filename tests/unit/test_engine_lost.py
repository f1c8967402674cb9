"""Engine.lost: how long a request that met a refusing engine socket waits before queueing again."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from mlxd.supervisor.engines.engine import Engine, EngineOptions, EngineState


def ready_engine(tmp_path: Path, deadline_s: float = 30.0) -> Engine:
    engine = Engine("m", Path("/m"), tmp_path, options=EngineOptions(health_deadline_s=deadline_s, grace_s=0.0))
    engine.state, engine.pid = EngineState.READY, 4242
    return engine


def test_it_waits_while_the_socket_refuses_until_another_run_serves(tmp_path: Path) -> None:
    engine = ready_engine(tmp_path)  # no socket file: every connection fails

    async def go() -> float:
        started = time.monotonic()
        asyncio.get_running_loop().call_later(0.5, setattr, engine, "pid", 4343)  # the restart's new process
        await engine.lost(4242)
        return time.monotonic() - started

    assert 0.45 < asyncio.run(go()) < 5


def test_it_returns_once_the_socket_takes_a_connection_again(tmp_path: Path) -> None:
    engine = ready_engine(tmp_path)

    async def go() -> float:
        started = time.monotonic()

        async def listen_later() -> asyncio.AbstractServer:
            await asyncio.sleep(0.3)  # a refusal that passes: the same process listens again
            return await asyncio.start_unix_server(lambda r, w: w.close(), path=str(engine.socket))

        server = asyncio.ensure_future(listen_later())
        await engine.lost(4242)
        waited = time.monotonic() - started
        (await server).close()
        return waited

    assert 0.25 < asyncio.run(go()) < 5
    assert engine.pid == 4242  # nothing else changed: it returned for the connection


def test_it_gives_up_after_the_health_deadline(tmp_path: Path) -> None:
    engine = ready_engine(tmp_path, deadline_s=0.3)

    async def go() -> float:
        started = time.monotonic()
        await engine.lost(4242)
        return time.monotonic() - started

    assert 0.25 < asyncio.run(go()) < 5
