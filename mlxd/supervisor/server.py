"""Run the supervisor: the TCP front door, until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

from aiohttp import web

from mlxd.event_loop import loop_factory, loop_name
from mlxd.fdlimit import raise_open_file_limit
from mlxd.hub.removal import OwnedModels
from mlxd.paths import adapters_dir, ensure_private_dir, models_dir, runtime_dir
from mlxd.protocol.process import STREAM_KEEPALIVE_ENV
from mlxd.supervisor.adapters import AdapterCatalog
from mlxd.supervisor.config import Config, ServerConfig
from mlxd.supervisor.engines.engine import EngineOptions
from mlxd.supervisor.engines.pool import Pool
from mlxd.supervisor.http.app import make_app
from mlxd.supervisor.http.connections import ConnectionTable, GuardedSite
from mlxd.supervisor.jobs.store import JobStore
from mlxd.supervisor.lab_files import LabFiles
from mlxd.supervisor.library import Bandwidth
from mlxd.supervisor.registry import Registry, hf_cache_dir
from mlxd.supervisor.response_store import ResponseStore, StoreError

log = logging.getLogger("mlxd.supervisor")
# In-flight requests get this long to finish at shutdown before engines are stopped.
SHUTDOWN_TIMEOUT_S = 10.0
LINGER_S = 2.0  # an unread body (a 413, say) is read and dropped this long before the close


def remove_stale_sockets(runtime: Path) -> list[Path]:
    """Delete engine sockets that nothing answers on (left by a supervisor that was killed)."""
    removed = []
    for path in runtime.glob("e-*.sock"):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
        finally:
            probe.close()
    return removed


def serve(config: Config, data_dir: Path) -> int:
    """Serve until a signal; return the exit code."""
    started = time.perf_counter()
    raise_open_file_limit()
    runtime = ensure_private_dir(runtime_dir())
    if stale := remove_stale_sockets(runtime):
        log.info("removed %d stale engine socket(s) in %s", len(stale), runtime)
    # Engines inherit it: a stream queued inside an engine gets the same keep-alive comments.
    os.environ.setdefault(STREAM_KEEPALIVE_ENV, str(config.server.stream_keepalive_s))
    registry = Registry(config.models, models_dir=models_dir(data_dir), batch=config.pool.batch,
                        draft=config.pool.draft, defaults=config.defaults)
    try:
        store = ResponseStore(data_dir / "responses.sqlite3", config.responses.ttl_s, config.responses.max_bytes)
    except StoreError as exc:
        log.error("cannot open the response store: %s (move the file away to start a new one)", exc)
        return 1
    pool = Pool(runtime, EngineOptions.from_env(), config.pool, kv_dir=data_dir / "kv")
    adapters = AdapterCatalog(adapters_dir(data_dir), models_dir(data_dir))
    app = make_app(config, registry, pool, store, adapters, JobStore(data_dir / "jobs"), LabFiles(data_dir),
                   OwnedModels(data_dir, hf_cache_dir()),
                   Bandwidth(data_dir / "probe" / "bandwidth.json", pool.engine_env))
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(run(app, config.server, started))


async def run(app: web.Application, server: ServerConfig, started: float) -> int:
    """Bind, serve, and on a signal: stop accepting, let requests finish, stop engines."""
    host, port = server.host, server.port
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        keepalive_timeout=server.keepalive_timeout_s, lingering_time=LINGER_S,
    )
    await runner.setup()
    connections = ConnectionTable(server.max_connections, server.max_connections_per_peer, server.head_timeout_s)
    try:
        await GuardedSite(runner, host, port, connections).start()
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", host, port, exc.strerror or exc)
        await runner.cleanup()
        return 1
    loop_kind = loop_name(asyncio.get_running_loop())
    took_ms = (time.perf_counter() - started) * 1000
    log.info("mlxd serving on http://%s:%d/v1 (up in %.0f ms, %s loop)", host, port, took_ms, loop_kind)
    # Warm what the first real request needs, off the start-up path (see metrics.py).
    threading.Thread(target=importlib.import_module, args=("prometheus_client",), daemon=True).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: finishing in-flight requests, then stopping engines")
    await runner.cleanup()
    log.info("stopped")
    return 0
