"""Run the engine: bind the Unix socket, load the model on the GPU thread, serve until told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
from aiohttp import web

from mlxd.engine import blas
from mlxd.engine.embed.gateway import EmbedGateway
from mlxd.engine.embed.model import EmbeddingModel, is_embedding_dir
from mlxd.engine.gpu.gateway import STOPPING as STOPPING_EVENT
from mlxd.engine.gpu.gateway import Gateway
from mlxd.engine.gpu.options import GatewayOptions
from mlxd.engine.gpu.stats import Stats
from mlxd.engine.group.follower import follow
from mlxd.engine.group.ranks import Leader, kept_line, splitter
from mlxd.engine.http.app import make_app
from mlxd.engine.models.load_meter import LoadMeter
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.engine.parent_watch import set_death_signal, watch_parent
from mlxd.engine.settings import EngineSettings
from mlxd.engine.spec.config import DraftConfig
from mlxd.event_loop import loop_factory, loop_name
from mlxd.paths import check_private_dir, data_dir
from mlxd.protocol.exit_codes import ExitCode
from mlxd.protocol.memory import default_prompt_cache_bytes

log = logging.getLogger("mlxd.engine")
MAX_SOCKET_PATH = 104 if sys.platform == "darwin" else 108
# Open requests are answered at once on stop, so handlers end quickly; aiohttp applies this
# twice (graceful, then after cancelling), which keeps exit well inside 2 s.
SHUTDOWN_TIMEOUT_S = 0.3
# On SIGTERM the prompt cache's RAM entries are written to SSD first, for at most this long:
# within the supervisor's 5 s before SIGKILL. (It drains an engine, which writes them, before
# a swap or unload; at its own shutdown this is the only write, and write-behind has usually
# written most entries already.)
STOP_FLUSH_S = 4.0


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
    set_death_signal()  # again, for callers that did not come through __main__
    parent = settings.parent_pid or os.getppid()
    if os.getppid() != parent:  # it died while we started (the death signal came too late)
        log.error("parent process %d is gone; not starting", parent)
        return ExitCode.PARENT_GONE
    if switch_ms := os.environ.get("MLXD_GIL_SWITCH_MS"):
        sys.setswitchinterval(float(switch_ms) / 1000)
    log.info("mlxd engine pid %d: model %s from %s", os.getpid(), settings.model_id, settings.model)
    log.info(blas.describe())
    group = None
    if settings.group_control is not None:
        try:
            group = join_group(settings)
        except RuntimeError as exc:
            log.error("cannot join the engine group: %s", exc)
            return ExitCode.ENGINE_BOOT_ERROR
        if group.rank() > 0:
            return follow_rank0(settings, group)
    try:
        sock = bind_unix(settings.socket)
    except BootError as exc:
        log.error("cannot start: %s", exc)
        return ExitCode.ENGINE_BOOT_ERROR
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:  # uvloop, as the supervisor's (event_loop.py)
            return runner.run(run(settings, sock, parent, group))
    finally:
        # The loop's close gave SIGTERM its default action back; a late repeat of the
        # parent-death signal (see run) finds us exiting anyway.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        remove_socket(settings.socket)


def remove_socket(path: Path) -> None:
    """Unlink our socket file (gone already is fine)."""
    with contextlib.suppress(OSError):
        path.unlink()


async def run(settings: EngineSettings, sock: socket.socket, parent: int, group: Any = None) -> int:
    """The engine's event loop: serve, load the model, wait for a reason to stop. `group`: rank
    0's mx.distributed group, when the engine is one of several (docs/distributed.md)."""
    loop = asyncio.get_running_loop()
    stats = Stats()
    meter = LoadMeter()
    def load() -> LoadedModel:
        split = splitter(group, settings.group_mode) if group is not None else None
        loaded = LoadedModel(settings.model, settings.model_id, settings.max_context, meter, split)
        if settings.defaults is not None:
            loaded.configured = settings.defaults
        if group is not None:
            loaded.split = f"{settings.group_mode} 0/{group.size()}"
            log.info(kept_line(0, loaded.model))
        return loaded

    def load_embedder() -> EmbeddingModel:
        return EmbeddingModel(settings.model, settings.model_id, settings.max_context, meter)

    options = gateway_options(settings)
    gateway = (EmbedGateway(load_embedder, stats, options, meter) if is_embedding_dir(settings.model)
               else Gateway(load, stats, options, meter))
    if group is not None and settings.group_control is not None and isinstance(gateway, Gateway):
        gateway.group = Leader(settings.group_control, group.size(), settings.group_heartbeat_s,
                               settings.group_turn_timeout_s)
    stopped: asyncio.Future[ExitCode] = loop.create_future()

    def stop(code: ExitCode) -> None:
        if not stopped.done():
            stopped.set_result(code)

    def on_signal() -> None:
        # On Linux a parent's death arrives as SIGTERM (PR_SET_PDEATHSIG).
        stop(ExitCode.PARENT_GONE if os.getppid() != parent else ExitCode.OK)

    def on_ready() -> None:  # GPU thread
        loop.call_soon_threadsafe(log_ready, gateway)

    def on_exit() -> None:  # GPU thread
        loop.call_soon_threadsafe(stop, gpu_exit_code(gateway))

    gateway.on_ready, gateway.on_exit = on_ready, on_exit
    if isinstance(gateway, Gateway) and gateway.group is not None:  # a rank gone ends the group
        gateway.group.on_lost = lambda: loop.call_soon_threadsafe(stop, ExitCode.GPU_THREAD_DIED)
    runner = web.AppRunner(
        make_app(settings, gateway, stats), handler_cancellation=True, access_log=None,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    await runner.setup()  # starts the GPU thread (the app's cleanup context owns it)
    await web.SockSite(runner, sock, backlog=1024).start()  # the kernel may cap it (macOS: 128)
    log.info("listening on %s (%s loop); loading the model", settings.socket, loop_name(asyncio.get_running_loop()))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    watcher = loop.create_task(watch_parent(parent, lambda: stop(ExitCode.PARENT_GONE)))
    code = await stopped
    if code == ExitCode.OK and gateway.is_loaded:
        # SIGTERM drains the prompt cache: requests in flight end now, then RAM entries go to SSD.
        gateway.abort_open(STOPPING_EVENT)
        with contextlib.suppress(Exception):
            report = await asyncio.wait_for(asyncio.wrap_future(gateway.flush_cache(STOP_FLUSH_S)), STOP_FLUSH_S + 0.5)
            log.info("on stop: prompt cache to SSD: %d written (%.1f MB, %.0f ms)%s", report.entries,
                     report.bytes / 1e6, report.ms, "" if report.complete else "; some not written")
    # First, while our SIGTERM handler still stands: a parent that dies sends the death signal
    # again at each reparenting (to each of its threads, then to init), and one landing after
    # the loop has closed would kill us with the socket file left behind
    # (test_sigkill_of_the_supervisor_takes_engines_down_within_2s).
    remove_socket(settings.socket)
    watcher.cancel()
    gateway.stop()  # answer open requests now, so the runner's cleanup finds none waiting
    if isinstance(gateway, Gateway) and gateway.group is not None and code == ExitCode.OK:
        await asyncio.to_thread(gateway.join, GROUP_STOP_S)  # its last turn ends the other ranks too
    await runner.cleanup()
    log.info("engine stopped (exit %d)", code)
    return int(code)


GROUP_STOP_S = 5.0  # on a stop, what rank 0 waits for its GPU thread's last turn (the others' stop)


def gateway_options(settings: EngineSettings) -> GatewayOptions:
    """The GPU gateway's options from the command line, defaults filled in for this machine."""
    batch = settings.batch
    if settings.kv_bits is not None and batch != 1:
        log.warning("--kv-bits %d: quantized KV runs in the serial lane only; batch width %s -> 1",
                    settings.kv_bits, "auto" if batch is None else batch)
        batch = 1
    cache_bytes = settings.prompt_cache_bytes
    if cache_bytes is None:
        cache_bytes = default_prompt_cache_bytes(psutil.virtual_memory().total)
    options = GatewayOptions(
        prefill_step=settings.prefill_step, solo_prefill_step=settings.solo_prefill_step or 0, batch=batch,
        memory_bytes=settings.memory_bytes,
        max_context=settings.max_context,
        kv_budget_tokens=settings.kv_budget_tokens, warmup=settings.warmup, width_probe=settings.width_probe, probe_dir=data_dir() / "probe",
        gather_ms=settings.gather_ms,
        prompt_cache_bytes=cache_bytes, prompt_cache_auto=settings.prompt_cache_bytes is None,
        ssd_root=settings.ssd_cache_dir or data_dir() / "kv",
        ssd_cache_bytes=settings.ssd_cache_bytes, kv_bits=settings.kv_bits, kv_group_size=settings.kv_group_size,
        write_behind=settings.write_behind, generation_checkpoint=settings.generation_checkpoint,
        adapter_merge=settings.adapter_merge,
        draft=DraftConfig.parse(settings.draft, settings.num_draft_tokens),
    )
    if settings.group_control is None:
        return options
    # What a group's ranks cannot agree on yet (docs/distributed.md): off, and said so. n-gram
    # drafts are rank 0's decisions, which the others take (spec/agreement.py); a draft model or
    # a self-draft would make passes of its own on every rank.
    draft = options.draft
    if draft.kind in ("self", "model"):
        log.warning("engine group: drafts from %s are not made in a group yet: no speculative decoding", draft.label)
        draft = DraftConfig()
    log.info("engine group: no width probe or warm-up yet")
    return replace(options, draft=draft, width_probe="off", warmup="off")


def join_group(settings: EngineSettings) -> Any:
    """This process's mx.distributed group (its rank and peers from the backend's variables)."""
    import mlx.core as mx

    if _world_size(settings.group_backend) == 1:  # a group of one (benchmarks/group_decode.py): no peers to reach
        for name in ("MLX_HOSTFILE", "MLX_WORLD_SIZE", "MLX_RANK"):
            os.environ.pop(name, None)
        group = mx.distributed.init()
    else:
        group = mx.distributed.init(strict=True, backend=settings.group_backend)
    log.info("engine group: rank %d of %d (%s, %s)", group.rank(), group.size(), settings.group_backend,
             settings.group_mode)
    return group


def _world_size(backend: str) -> int:
    """How many ranks the backend's variables name (0: not known from them)."""
    if backend == "ring" and (hostfile := os.environ.get("MLX_HOSTFILE")):
        with contextlib.suppress(OSError, ValueError):
            return len(json.loads(Path(hostfile).read_text()))
    with contextlib.suppress(ValueError):
        return int(os.environ.get("MLX_WORLD_SIZE", "0"))
    return 0


def follow_rank0(settings: EngineSettings, group: Any) -> int:
    """A rank other than 0: load this rank's shard, then replay rank 0's turns."""
    assert settings.group_control is not None
    shard_or_error: LoadedModel | str
    try:
        shard_or_error = LoadedModel(settings.model, settings.model_id, settings.max_context,
                                     split=splitter(group, settings.group_mode))
        shard_or_error.split = f"{settings.group_mode} {group.rank()}/{group.size()}"
        log.info(kept_line(group.rank(), shard_or_error.model))
    except Exception as exc:  # any: rank 0 names it in its load error
        log.error("rank %d: model load failed: %s", group.rank(), exc)
        shard_or_error = str(exc) or type(exc).__name__
    try:
        own = gateway_options(settings)  # this rank's SSD tier: its own dir, of its own part
        return follow(shard_or_error, group.rank(), settings.group_control, heartbeat_s=settings.group_heartbeat_s,
                      ssd=(own.ssd_root, own.ssd_cache_bytes))
    except Exception:
        log.exception("rank %d: the group failed", group.rank())
        return ExitCode.GPU_THREAD_DIED


def gpu_exit_code(gateway: Gateway) -> ExitCode:
    """Why the GPU thread ended: a load error, a requested stop, or an unexpected death."""
    if gateway.load_error:
        return ExitCode.MODEL_LOAD_ERROR
    if gateway.is_stopping:
        return ExitCode.OK
    log.error("the GPU thread ended unexpectedly")
    return ExitCode.GPU_THREAD_DIED


def log_ready(gateway: Gateway) -> None:
    """Log readiness (on the loop, once the GPU thread has loaded the model)."""
    if gateway.context_window is not None:
        log.info("ready: context window %d tokens", gateway.context_window)
