"""Run the engine: bind the Unix socket, load the model on the GPU thread, serve until told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from aiohttp import web

from mlxd.engine import blas
from mlxd.engine.app import make_app
from mlxd.engine.gateway import Gateway
from mlxd.engine.loaded_model import LoadedModel
from mlxd.engine.parent_watch import set_death_signal, watch_parent
from mlxd.engine.settings import EngineSettings
from mlxd.engine.stats import Stats
from mlxd.paths import check_private_dir
from mlxd.protocol.exit_codes import ExitCode

log = logging.getLogger("mlxd.engine")
MAX_SOCKET_PATH = 104 if sys.platform == "darwin" else 108
SHUTDOWN_TIMEOUT_S = 1.0
# While decoding, the GPU thread seldom blocks (mlx-lm evaluates a step ahead), so the loop
# thread waits for the GIL's forced switch before relaying a token: 5 ms by default. On an
# H200 a 0.5 ms interval took TTFT overhead from 3.7 to 1.3 ms (benchmarks/engine_decode.py).
GIL_SWITCH_S = 0.0005


class BootError(Exception):
    """The engine cannot start serving (socket dir, socket path, another server)."""


def bind_unix(path: Path) -> socket.socket:
    """A listening-ready Unix socket at `path`, mode 0600, in a private dir."""
    try:
        check_private_dir(path.parent)
    except (OSError, PermissionError) as exc:
        raise BootError(f"unsafe socket dir: {exc}") from exc
    if len(os.fsencode(path)) >= MAX_SOCKET_PATH:
        raise BootError(f"socket path is {len(os.fsencode(path))} bytes; the limit is {MAX_SOCKET_PATH - 1}")
    if path.exists() or path.is_symlink():
        remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(os.fspath(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return sock


def remove_stale_socket(path: Path) -> None:
    """Unlink a leftover socket file; refuse if something still answers on it."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(os.fspath(path))
    except OSError:
        path.unlink()
        return
    finally:
        probe.close()
    raise BootError(f"another process is serving {path}")


def serve(settings: EngineSettings) -> int:
    """Serve until SIGTERM/SIGINT or parent death; return the exit code."""
    set_death_signal()
    sys.setswitchinterval(GIL_SWITCH_S)
    log.info("mlxd engine pid %d: model %s from %s", os.getpid(), settings.model_id, settings.model)
    log.info(blas.describe())
    if settings.batch > 1:
        log.warning("--batch %d: continuous batching is not built yet; requests run one at a time", settings.batch)
    try:
        sock = bind_unix(settings.socket)
    except BootError as exc:
        log.error("cannot start: %s", exc)
        return ExitCode.ENGINE_BOOT_ERROR
    try:
        return asyncio.run(run(settings, sock))
    finally:
        with contextlib.suppress(OSError):
            settings.socket.unlink()


async def run(settings: EngineSettings, sock: socket.socket) -> int:
    """The engine's event loop: start serving, load the model, wait for a reason to stop."""
    loop = asyncio.get_running_loop()
    stats = Stats()
    load = lambda: LoadedModel(settings.model, settings.model_id, settings.max_context)  # noqa: E731
    gateway = Gateway(load, stats, settings.prefill_step)
    done = asyncio.Event()

    def notify_loaded() -> None:  # runs on the GPU thread
        loop.call_soon_threadsafe(on_loaded, gateway, done)

    gateway.on_loaded = notify_loaded
    exit_code = [ExitCode.OK]

    def stop(code: ExitCode) -> None:
        exit_code[0] = code
        done.set()

    runner = web.AppRunner(make_app(settings, gateway, stats), handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    log.info("listening on %s; loading the model", settings.socket)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, ExitCode.OK)
    watcher = loop.create_task(watch_parent(settings.parent_pid or os.getppid(), lambda: stop(ExitCode.PARENT_GONE)))
    gateway.start()
    await done.wait()
    if gateway.load_error:
        log.error("exiting: the model could not be loaded")
        exit_code[0] = ExitCode.MODEL_LOAD_ERROR
    watcher.cancel()
    gateway.stop(timeout=0.0)  # cancel jobs now so handlers finish before the runner's timeout
    await runner.cleanup()
    log.info("engine stopped (exit %d)", exit_code[0])
    return int(exit_code[0])


def on_loaded(gateway: Gateway, done: asyncio.Event) -> None:
    """On the loop, once the GPU thread finished loading: log readiness or end the engine."""
    if gateway.loaded is not None:
        log.info("ready: context window %d tokens", gateway.loaded.context_window)
    else:
        done.set()
