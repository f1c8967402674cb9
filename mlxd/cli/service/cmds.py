"""`mlxd start|stop|status` and `mlxd service install|uninstall`.

The daemon runs through the installed service when there is one (a launchd agent on macOS,
a systemd user unit on Linux), else as a detached `mlxd serve` with a pid file. Everything
that touches the OS goes through `System`, so unit tests swap in fakes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import click
import psutil

from mlxd.cli.options import data_dir_option, serve_options
from mlxd.cli.service import spec as svc
from mlxd.cli.service.managers import (
    Backend,
    Health,
    System,
    Systemd,
    backend_for,
    current_system,
    installed_backend,
)
from mlxd.cli.service.spec import PidRecord, ServeOptions

EXIT_DOWN = 3  # `mlxd status` when nothing answers, like `systemctl status`


def resolve_data_dir(opts: ServeOptions) -> Path:
    """The data dir in effect for these options."""
    from mlxd.paths import data_dir

    return (opts.data_dir or data_dir()).expanduser().absolute()


def resolve_address(opts: ServeOptions, env: Mapping[str, str]) -> tuple[str, int]:
    """Host and port `mlxd serve` would listen on with these options and env."""
    from mlxd.supervisor.config import (
        ConfigError,
        apply_overrides,
        config_path,
        is_explicit_config,
        load_config,
    )

    cli_config = str(opts.config) if opts.config else None
    try:
        cfg = load_config(config_path(cli_config, env), explicit=is_explicit_config(cli_config, env))
        server = apply_overrides(cfg, host=opts.host, port=opts.port, env=env).server
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    return server.host, server.port


def is_daemon(pid: int) -> bool:
    """Whether `pid` is a live (not zombie) `mlxd serve`: a recycled pid is some other program."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        cmdline = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return "mlxd" in " ".join(cmdline) and "serve" in cmdline


def live_record(pid_path: Path) -> PidRecord | None:
    """The pid file's record when its daemon still runs; a stale file is removed."""
    record = svc.read_pid_file(pid_path)
    if record is not None and is_daemon(record.pid):
        return record
    svc.remove_pid_file(pid_path)
    return None


def service_url(backend: Backend, system: System) -> str:
    """Where the installed service answers."""
    opts = backend.options()
    env = {k: v for k, v in system.env.items() if k not in ("MLXD_HOST", "MLXD_PORT", "MLXD_CONFIG")}
    return svc.base_url(*resolve_address(opts, {**env, **opts.service_env()}))


def wait_up(system: System, url: str, is_running: Callable[[], bool]) -> Health | None:
    """Poll /health until it answers; None when the daemon dies or the timeout passes."""
    health: Health | None = None

    def answered() -> bool:
        nonlocal health
        health = system.probe(url)
        return health is not None or not is_running()

    system.wait_for(answered, svc.START_TIMEOUT_S)
    return health


def prepare_files(data_dir: Path) -> Path:
    """Make the data dir's log and pid file private, saying what changed; the log's path."""
    try:
        lines = svc.secure_files(data_dir)
    except OSError as exc:
        raise click.ClickException(f"cannot prepare mlxd's log: {exc.filename or data_dir}: {exc.strerror or exc}") from None
    for line in lines:
        click.echo(line, err=True)
    return svc.log_file(data_dir)


def failure(what: str, log: Path) -> click.ClickException:
    """An error that ends with the log's tail."""
    return click.ClickException(f"{what}\n--- last lines of {log} ---\n{svc.log_tail(log)}")


# --- start -----------------------------------------------------------------------


def start_daemon(system: System, opts: ServeOptions) -> str:
    """Start mlxd in the background; return what to tell the user once /health answers."""
    backend = installed_backend(system)
    if backend is not None:
        if opts != ServeOptions():
            raise click.ClickException(
                f"mlxd runs as a {backend.kind} ({backend.path}); its options are set by "
                "`mlxd service install --host/--port/--config`, not by `mlxd start`"
            )
        return start_service(system, backend)
    return start_detached(system, opts)


def start_service(system: System, backend: Backend) -> str:
    """Start the installed service and wait for /health."""
    url = service_url(backend, system)
    if (health := system.probe(url)) is not None:
        return f"mlxd is already running at {url} (version {health.get('version')}, {backend.kind})"
    log = prepare_files(resolve_data_dir(backend.options()))  # before the service manager opens the log
    backend.start()
    if wait_up(system, url, lambda: True) is None:
        raise failure(f"mlxd ({backend.kind}) did not answer {url}/health in {svc.START_TIMEOUT_S:.0f} s", log)
    return f"mlxd is running at {url} ({backend.kind} {backend.path})"


def start_detached(system: System, opts: ServeOptions) -> str:
    """Spawn a detached `mlxd serve` with a pid file, unless one already runs."""
    data = resolve_data_dir(opts)
    pid_path, log = svc.pid_file(data), svc.log_file(data)
    host, port = resolve_address(opts, system.env)
    url = svc.base_url(host, port)
    if (record := live_record(pid_path)) is not None:
        return already_running(system, record, url, pid_path)
    if system.probe(url) is not None:
        raise click.ClickException(f"another mlxd already answers at {url} (not one `mlxd start` started)")
    prepare_files(data)
    argv = ServeOptions(opts.host, opts.port, svc.absolute(opts.config), data).serve_argv(system.python)
    proc = spawn_detached(argv, log)
    svc.write_pid_file(pid_path, svc.new_record(proc.pid, host, port))
    if wait_up(system, url, lambda: proc.poll() is None) is not None:
        return f"mlxd is running at {url} (pid {proc.pid}, log {log})"
    if proc.poll() is None:
        stop_pid(system, proc.pid)
    proc.wait()
    svc.remove_pid_file(pid_path)
    why = f"exited with code {proc.returncode}" if proc.returncode > 0 else "did not start"
    raise failure(f"mlxd {why} before {url}/health answered (timeout {svc.START_TIMEOUT_S:.0f} s)", log)


def already_running(system: System, record: PidRecord, url: str, pid_path: Path) -> str:
    """The answer to `mlxd start` when the pid file names a live daemon."""
    if system.probe(record.url) is None:
        raise click.ClickException(
            f"mlxd (pid {record.pid}, {pid_path}) is running but {record.url}/health does not "
            "answer; run `mlxd stop` first"
        )
    if record.url != url:
        raise click.ClickException(
            f"mlxd is already running at {record.url} (pid {record.pid}), not {url}; run `mlxd stop` first"
        )
    return f"mlxd is already running at {record.url} (pid {record.pid}, pid file {pid_path})"


def spawn_detached(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start `argv` in its own session, stdin from /dev/null, output appended to `log` (0600)."""
    with open(svc.open_log(log), "ab") as out:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True,
        )


# --- stop ------------------------------------------------------------------------


def stop_pid(system: System, pid: int) -> bool:
    """SIGTERM, wait up to the stop timeout, then SIGKILL; True if it needed SIGKILL."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    if system.wait_for(lambda: not is_daemon(pid), svc.STOP_TIMEOUT_S):
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    system.wait_for(lambda: not is_daemon(pid), 5.0)
    return True


def stop_daemon(system: System, data_dir: Path) -> list[str]:
    """Stop the service and/or the pid-file daemon; what was stopped (empty: nothing ran)."""
    stopped = []
    backend = installed_backend(system)
    if backend is not None and backend.stop():
        stopped.append(f"mlxd stopped ({backend.kind})")
    pid_path = svc.pid_file(data_dir)
    if (record := live_record(pid_path)) is not None:
        killed = stop_pid(system, record.pid)
        stopped.append(f"mlxd stopped (pid {record.pid}{', after SIGKILL' if killed else ''})")
    svc.remove_pid_file(pid_path)
    return stopped


# --- status ----------------------------------------------------------------------


def daemon_status(system: System, data_dir: Path) -> dict[str, Any]:
    """Up or down, URL, version, engines, pid: the pid-file daemon, else the service, else the config."""
    record = live_record(svc.pid_file(data_dir))
    backend = installed_backend(system)
    pid, how = None, None
    if record is not None:
        url, pid, how = record.url, record.pid, "mlxd start"
    elif backend is not None:
        url, how = service_url(backend, system), backend.kind
    else:
        url = svc.base_url(*resolve_address(ServeOptions(data_dir=data_dir), system.env))
    health = system.probe(url)
    if backend is not None and record is None and health is not None:
        pid = backend.pid()
    return {
        "status": "up" if health else "down", "url": url,
        "version": health.get("version") if health else None,
        "engines": health.get("engines", {}) if health else {},
        "pid": pid, "managed_by": how,
    }


def describe_status(info: dict[str, Any]) -> str:
    """`mlxd status` for people."""
    if info["status"] == "down":
        return f"mlxd is down (nothing answers at {info['url']})"
    extra = [f"version {info['version']}"]
    if info["pid"]:
        extra.append(f"pid {info['pid']}")
    if info["managed_by"]:
        extra.append(f"via {info['managed_by']}")
    lines = [f"mlxd is up at {info['url']} ({', '.join(extra)})"]
    engines = info["engines"]
    lines.append("engines: " + (", ".join(f"{k} ({v})" for k, v in sorted(engines.items())) or "none loaded"))
    return "\n".join(lines)


# --- service install / uninstall -------------------------------------------------


def install_service(system: System, opts: ServeOptions) -> list[str]:
    """Write the agent/unit, then load it; the lines to print."""
    backend = backend_for(system)
    if backend is None:
        raise click.ClickException(f"`mlxd service` supports macOS (launchd) and Linux (systemd), not {system.platform}")
    opts = svc.from_env(opts, system.env)
    data = resolve_data_dir(opts)
    if (record := live_record(svc.pid_file(data))) is not None:
        raise click.ClickException(f"mlxd is running from `mlxd start` (pid {record.pid}); run `mlxd stop` first")
    url = svc.base_url(*resolve_address(opts, {**opts.service_env(), "HOME": str(system.home)}))
    log = prepare_files(data)
    backend.path.parent.mkdir(parents=True, exist_ok=True)
    backend.path.write_text(backend.render(opts, log))
    lines = [f"wrote {backend.path}"]
    if manual := backend.activate():
        return [*lines, "no systemd user session reachable; to enable and start it, run:", *(f"  {c}" for c in manual)]
    if wait_up(system, url, lambda: True) is None:
        raise failure(f"installed {backend.path}, but {url}/health did not answer in {svc.START_TIMEOUT_S:.0f} s", log)
    return [*lines, f"mlxd is running at {url} as a {backend.kind}; it starts at login. Log: {log}"]


def uninstall_service(system: System) -> list[str]:
    """Stop the service and remove its file; the lines to print."""
    backend = installed_backend(system)
    if backend is None:
        return ["no mlxd service installed"]
    manual = backend.deactivate()
    backend.path.unlink()
    if isinstance(backend, Systemd):
        backend.after_remove()
    lines = [f"removed {backend.path}"]
    return lines + (["to finish, run:", *(f"  {c}" for c in manual)] if manual else [])


# --- click commands --------------------------------------------------------------

@click.command("start")
@serve_options
def start(host: str | None, port: int | None, config_file: Path | None, data_dir: Path | None) -> None:
    """Run mlxd in the background (through the installed service if any); return once it answers."""
    opts = ServeOptions(host=host, port=port, config=config_file, data_dir=data_dir)
    click.echo(start_daemon(current_system(), opts))


@click.command("stop")
@data_dir_option
def stop(data_dir: Path | None) -> None:
    """Stop the background mlxd (exit 0 with "not running" when none runs)."""
    stopped = stop_daemon(current_system(), resolve_data_dir(ServeOptions(data_dir=data_dir)))
    click.echo("\n".join(stopped) if stopped else "mlxd is not running")


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="print a JSON object")
@data_dir_option
def status(as_json: bool, data_dir: Path | None) -> None:
    """Whether mlxd is up: URL, version, loaded engines, pid. Exit 0 when up, 3 when down."""
    info = daemon_status(current_system(), resolve_data_dir(ServeOptions(data_dir=data_dir)))
    click.echo(json.dumps(info) if as_json else describe_status(info))
    if info["status"] != "up":
        click.get_current_context().exit(EXIT_DOWN)


@click.group("service")
def service() -> None:
    """Install mlxd as a login service (launchd agent on macOS, systemd user unit on Linux)."""


@service.command("install")
@serve_options
def install(host: str | None, port: int | None, config_file: Path | None, data_dir: Path | None) -> None:
    """Write the launchd agent or systemd user unit, then enable and start it."""
    opts = ServeOptions(host=host, port=port, config=config_file, data_dir=data_dir)
    click.echo("\n".join(install_service(current_system(), opts)))


@service.command("uninstall")
def uninstall() -> None:
    """Stop the service and remove its launchd agent or systemd user unit."""
    click.echo("\n".join(uninstall_service(current_system())))
