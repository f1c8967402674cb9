"""`mlxd models|ps|load|unload|drain|lease`: the supervisor's admin API from the shell.

Tables for people, `--json` for scripts. Only the stdlib talks HTTP here (`admin_client`):
these commands must start fast and never import aiohttp or mlx.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import click

from mlxd.cli.admin.client import AdminClient, AdminError, HTTPFailure, normalize_url, resolve_key
from mlxd.cli.admin.tables import (
    drain_text,
    library_text,
    load_text,
    models_text,
    ps_text,
    shorten,
    unload_text,
)
from mlxd.cli.options import config_option, data_dir_option

if TYPE_CHECKING:
    from mlxd.cli.service.managers import System

DEFAULT_LEASE_TTL_S = 30.0
RENEW_TIMEOUT_S = 10.0
HOLDER_MAX_CHARS = 200
Hint = tuple[str, str]  # (the flag it suggests, the line to print)
EXIT_NOT_FOUND = 127  # the shell's codes for a command that cannot be run
EXIT_NOT_EXECUTABLE = 126


def describe_failure(exc: AdminError, client: AdminClient, hints: Mapping[str, Hint] | None = None) -> str:
    """The message for a failed call: the server's words, plus what to do about a 401 or a known code.

    A hint for the error's code is added unless the server's message already names its flag.
    """
    if not isinstance(exc, HTTPFailure):
        return str(exc)
    if exc.status == 401:
        if client.key_source:
            return (f"mlxd at {client.url} refused the key in ${client.key_source}: set MLXD_ADMIN_KEY to "
                    f"an admin key (server said: {exc.message})")
        return (f"mlxd at {client.url} needs a key: set MLXD_ADMIN_KEY to an admin key "
                f"(server said: {exc.message})")
    flag, hint = (hints or {}).get(exc.code or "", ("", ""))
    return exc.message + (f"\n{hint}" if hint and flag not in exc.message else "")


# --- finding the daemon -----------------------------------------------------------


def resolve_url(url: str | None, config: Path | None, data_dir: Path | None, system: System) -> str:
    """--url, else $MLXD_URL, else where `mlxd status` looks: --config, pid file, service, config."""
    given = url or system.env.get("MLXD_URL", "").strip()
    if given:
        try:
            return normalize_url(given)
        except ValueError as exc:
            raise click.UsageError(f"{'--url' if url else '$MLXD_URL'}: {exc}") from None
    return daemon_url(config, data_dir, system)


def daemon_url(config: Path | None, data_dir: Path | None, system: System) -> str:
    """The address `mlxd serve` listens on: the one `mlxd status` would ask (imports put off)."""
    from mlxd.cli.service import spec as svc
    from mlxd.cli.service.cmds import live_record, resolve_address, resolve_data_dir, service_url
    from mlxd.cli.service.managers import installed_backend
    from mlxd.cli.service.spec import ServeOptions

    if config is not None:
        return svc.base_url(*resolve_address(ServeOptions(config=config), system.env))
    if (record := live_record(svc.pid_file(resolve_data_dir(ServeOptions(data_dir=data_dir))))) is not None:
        return record.url
    if (backend := installed_backend(system)) is not None:
        return service_url(backend, system)
    return svc.base_url(*resolve_address(ServeOptions(), system.env))


def make_client(url: str | None, config: Path | None, data_dir: Path | None) -> AdminClient:
    """A client for the daemon these options name, with the key from the environment."""
    from mlxd.cli.service.managers import current_system

    system = current_system()
    return AdminClient(resolve_url(url, config, data_dir, system), *resolve_key(system.env))


@contextmanager
def failures_as_click(client: AdminClient, hints: Mapping[str, Hint] | None = None) -> Iterator[None]:
    """Turn an `AdminError` into a one-message exit 1."""
    try:
        yield
    except AdminError as exc:
        raise click.ClickException(describe_failure(exc, client, hints)) from None


def daemon_options(command: Callable[..., None]) -> Callable[..., None]:
    """--url, --config and --data-dir: which mlxd to talk to."""
    url_option = click.option("--url", help="mlxd's address (default: $MLXD_URL, else what `mlxd status` uses)")
    for option in (data_dir_option, config_option, url_option):
        command = option(command)
    return command


json_option = click.option("--json", "as_json", is_flag=True, help="print the server's JSON")


def emit(data: Any, as_json: bool, text: Callable[[Any], str]) -> None:
    """Print the server's JSON on one line, or `text(data)`."""
    click.echo(json.dumps(data) if as_json else text(data))


# --- lease: hold, renew, release around a command ----------------------------------


class Renewer:
    """Renews a lease every ttl/3 on a daemon thread; warns when the server says it is gone."""

    def __init__(self, client: AdminClient, lease_id: str, ttl_s: float) -> None:
        self.client, self.lease_id, self.ttl_s = client, lease_id, ttl_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-renewer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing; a renewal in progress is left to finish on its own (it is a daemon thread)."""
        self._done.set()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        is_failing = False  # warn once per run of failures, not every ttl/3
        while not self._done.wait(self.ttl_s / 3):
            try:
                self.client.post(lease_path(self.lease_id, "/renew"), {"ttl_s": self.ttl_s}, timeout=RENEW_TIMEOUT_S)
                is_failing = False
            except AdminError as exc:
                if self._done.is_set():
                    return
                if isinstance(exc, HTTPFailure) and exc.status == 404:
                    warn(f"lease {self.lease_id} was lost ({exc}); the command keeps running without it")
                    return
                if not is_failing:
                    warn(f"could not renew lease {self.lease_id} ({exc}); retrying every {self.ttl_s / 3:.3g} s")
                is_failing = True


def warn(text: str) -> None:
    """A `mlxd lease:` line on stderr."""
    click.echo(f"mlxd lease: {text}", err=True)


def lease_path(lease_id: str, suffix: str = "") -> str:
    """`/admin/leases/<id><suffix>`, the id quoted."""
    return f"/admin/leases/{quote(lease_id, safe='')}{suffix}"


def is_terminal_foreground() -> bool:
    """Whether we are in the terminal's foreground group: a Ctrl-C there reaches the child as well."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def should_forward(signum: int, is_foreground: Callable[[], bool] = is_terminal_foreground) -> bool:
    """SIGTERM and SIGHUP always; SIGINT unless the terminal already sent it to the child (no double Ctrl-C)."""
    return signum != signal.SIGINT or not is_foreground()


def exit_status(returncode: int) -> int:
    """A child's exit code as a shell reports it: 128+N when signal N killed it."""
    return 128 - returncode if returncode < 0 else returncode


class Forwarder:
    """Signal handler: pass SIGINT/SIGTERM/SIGHUP on to the child once it runs."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.received: int | None = None
        self.num_sent = 0

    def install(self) -> None:
        for signum in self.SIGNALS:
            signal.signal(signum, self)

    def attach(self, proc: subprocess.Popen[bytes]) -> None:
        """Forward to `proc` from now on, and pass on a signal that came while it started."""
        self.proc = proc
        if self.received is not None and not self.num_sent:
            self(self.received, None)

    def __call__(self, signum: int, frame: object) -> None:
        self.received = signum
        if self.proc is not None and should_forward(signum):
            self.num_sent += 1
            self.proc.send_signal(signum)


def run_leased(client: AdminClient, lease: Mapping[str, Any], command: list[str], ttl_s: float) -> int:
    """Run `command` holding `lease`: renew it meanwhile, release it however the command ends."""
    forwarder = Forwarder()
    forwarder.install()
    renewer = Renewer(client, lease["id"], ttl_s)
    renewer.start()
    try:
        if forwarder.received is not None:  # a signal came before the child existed: do not start it
            return 128 + forwarder.received
        env = {**os.environ, "MLXD_LEASE_ID": lease["id"], "MLXD_URL": client.url}
        try:
            proc = subprocess.Popen(command, env=env)
        except OSError as exc:
            warn(f"cannot run {command[0]}: {exc.strerror or exc}")
            return EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_NOT_EXECUTABLE
        forwarder.attach(proc)
        return exit_status(proc.wait())
    finally:
        renewer.stop()
        release(client, lease["id"], ttl_s)


def release(client: AdminClient, lease_id: str, ttl_s: float) -> None:
    """DELETE the lease; one already gone is fine; a failure is a warning (the lease expires anyway)."""
    try:
        client.delete(lease_path(lease_id))
    except AdminError as exc:
        if not (isinstance(exc, HTTPFailure) and exc.status == 404):
            warn(f"could not release lease {lease_id} ({exc}); it expires within {ttl_s:g} s")


def held_text(lease: Mapping[str, Any], command: list[str], ttl_s: float) -> str:
    """The stderr line once the lease is held."""
    target = lease.get("model") or "all models"
    return (f"mlxd lease: {lease['id']} held on {target} (ttl {ttl_s:g} s, renewed every {ttl_s / 3:.3g} s); "
            f"running {shlex.join(command)}")


class LeaseCommand(click.Command):
    """Everything after `--` is the command to run, kept away from click's option parsing."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            at = args.index("--")
            ctx.meta["mlxd.lease_command"] = args[at + 1 :]
            args = args[:at]
        return super().parse_args(ctx, args)

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [*super().collect_usage_pieces(ctx), "-- COMMAND [ARGS]..."]


def load_body(model: str, pin: bool | None) -> dict[str, Any]:
    """The POST /admin/load body: `pin` only when asked (sending false would unpin the model)."""
    return {"model": model} if pin is None else {"model": model, "pin": pin}


def lease_request(model: str | None, all_models: bool, command: list[str], ttl_s: float,
                  holder: str | None) -> dict[str, Any]:
    """The POST /admin/leases body; a usage error for a bad MODEL/--all/COMMAND combination."""
    if model and all_models:
        raise click.UsageError("give MODEL or --all, not both")
    if not model and not all_models:
        raise click.UsageError("give the MODEL to lease, or --all for every model")
    if not command:
        raise click.UsageError("missing COMMAND: mlxd lease MODEL -- COMMAND [ARGS]...")
    holder = holder or shorten(f"mlxd lease: {shlex.join(command)}", HOLDER_MAX_CHARS)
    return {"model": model or None, "ttl_s": ttl_s, "holder": holder}


# --- click commands -----------------------------------------------------------------


@click.command("models")
@click.option("--fit", "with_fit", is_flag=True,
              help="whether each fits this machine, and its decode speed predicted and measured (GET /library; "
                   "the first time, the machine's bandwidth is measured: a few seconds)")
@json_option
@daemon_options
def models(with_fit: bool, as_json: bool, url: str | None, config_file: Path | None, data_dir: Path | None) -> None:
    """List the models mlxd can serve (GET /v1/models, or with --fit GET /library)."""
    client = make_client(url, config_file, data_dir)
    with failures_as_click(client):
        if with_fit:
            emit(client.get("/library?wait_s=120"), as_json, library_text)
        else:
            emit(client.get("/v1/models"), as_json, models_text)


@click.command("ps")
@json_option
@daemon_options
def ps(as_json: bool, url: str | None, config_file: Path | None, data_dir: Path | None) -> None:
    """List the loaded models: state, memory, pid, work, when they unload, leases."""
    client = make_client(url, config_file, data_dir)
    with failures_as_click(client):
        emit(client.get("/admin/engines"), as_json, ps_text)


@click.command("load")
@click.argument("model")
@click.option("--pin/--no-pin", default=None,
              help="keep it loaded (no idle unload, no eviction) / unpin it; default: leave as is")
@json_option
@daemon_options
def load(model: str, pin: bool | None, as_json: bool, url: str | None, config_file: Path | None,
         data_dir: Path | None) -> None:
    """Load MODEL and wait until it is ready (its progress shown on a terminal)."""
    from mlxd.cli.admin.load_progress import LoadProgress, engine_load

    client = make_client(url, config_file, data_dir)
    shown = not as_json and sys.stderr.isatty()
    with failures_as_click(client), LoadProgress(model, engine_load(client, model), shown):
        answer = client.post("/admin/load", load_body(model, pin), timeout=None)
    emit(answer, as_json, load_text)


@click.command("unload")
@click.argument("model")
@click.option("--force", is_flag=True, help="unload it even when it is pinned")
@json_option
@daemon_options
def unload(model: str, force: bool, as_json: bool, url: str | None, config_file: Path | None,
           data_dir: Path | None) -> None:
    """Drain MODEL (finish its in-flight requests) and stop its engine."""
    client = make_client(url, config_file, data_dir)
    hints = {"model_pinned": ("--force", f"use `mlxd unload --force {shlex.quote(model)}` to unload it anyway")}
    with failures_as_click(client, hints):
        emit(client.post("/admin/unload", {"model": model, "force": force}, timeout=None), as_json, unload_text)


@click.command("drain")
@click.argument("model", required=False)
@json_option
@daemon_options
def drain(model: str | None, as_json: bool, url: str | None, config_file: Path | None,
          data_dir: Path | None) -> None:
    """Let MODEL's (default: every model's) in-flight work finish and write its prompt cache to disk."""
    client = make_client(url, config_file, data_dir)
    with failures_as_click(client):
        emit(client.post("/admin/drain", {"model": model} if model else {}, timeout=None), as_json, drain_text)


@click.command("lease", cls=LeaseCommand)
@click.argument("model", required=False)
@click.option("--all", "all_models", is_flag=True, help="lease the whole machine (every model) instead of one model")
@click.option("--ttl", "ttl_s", type=click.FloatRange(min=1.0), default=DEFAULT_LEASE_TTL_S, show_default=True,
              help="seconds the lease outlives a dead `mlxd lease`; renewed every ttl/3")
@click.option("--holder", help='who holds it, shown by `mlxd ps` (default "mlxd lease: COMMAND")')
@click.option("--json", "as_json", is_flag=True, help="print the lease as a JSON line on stdout once held")
@daemon_options
def lease(model: str | None, all_models: bool, ttl_s: float, holder: str | None, as_json: bool,
          url: str | None, config_file: Path | None, data_dir: Path | None) -> None:
    """Hold MODEL's (or --all models') exclusive lease while `-- COMMAND...` runs; exit with its code.

    The command gets MLXD_LEASE_ID and MLXD_URL; its requests carrying the header
    `X-MLXD-Lease: $MLXD_LEASE_ID` pass the lease.
    """
    ctx = click.get_current_context()
    command = list(ctx.meta.get("mlxd.lease_command", []))
    body = lease_request(model, all_models, command, ttl_s, holder)
    client = make_client(url, config_file, data_dir)
    with failures_as_click(client):
        try:
            held = client.post("/admin/leases", body, timeout=None)
        except KeyboardInterrupt:
            click.echo("mlxd lease: interrupted while waiting for the lease", err=True)
            ctx.exit(128 + signal.SIGINT)
    if as_json:
        click.echo(json.dumps(held))  # flushed: it comes before anything the command prints
    else:
        click.echo(held_text(held, command, ttl_s), err=True)
    ctx.exit(run_leased(client, held, command, ttl_s))
