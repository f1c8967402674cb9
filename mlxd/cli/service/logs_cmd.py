"""`mlxd logs [-f] [-n N]`: the daemon's log, wherever the way it runs keeps it.

The daemon is found as `mlxd status` finds it: a `mlxd start` daemon (pid file) logs to the
data dir's log; an installed service logs where its plist or unit says (a file, or the
journal); else the data dir's log of the last run. Lines are printed as they are, bytes in.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import click

from mlxd.cli.options import data_dir_option
from mlxd.cli.service import spec as svc
from mlxd.cli.service.managers import Backend, System, Systemd, current_system, installed_backend
from mlxd.cli.service.spec import ServeOptions

POLL_S = 0.2  # how often `-f` looks for new lines: `tail -f` waits 1 s
BLOCK = 64 * 1024


@dataclass(frozen=True)
class LogFile:
    """A log the daemon appends to; `never_ran` says no background mlxd writes it now."""

    path: Path
    never_ran: bool = False


@dataclass(frozen=True)
class Journal:
    """A systemd unit that logs to the journal: read through `journalctl`."""

    unit: Systemd


def find_log(system: System, data_dir: Path | None) -> LogFile | Journal:
    """Where the daemon's log is: an explicit data dir's, the `mlxd start` daemon's, the service's, the last run's."""
    from mlxd.cli.service.cmds import live_record, resolve_data_dir

    data = resolve_data_dir(ServeOptions(data_dir=data_dir))
    if data_dir is not None or live_record(svc.pid_file(data)) is not None:
        return LogFile(svc.log_file(data))
    backend = installed_backend(system)
    if backend is None:
        return LogFile(svc.log_file(data), never_ran=True)
    return service_log(backend)


def service_log(backend: Backend) -> LogFile | Journal:
    """The installed service's log file, or its journal."""
    import plistlib

    try:
        path = backend.log_path()
    except (OSError, ValueError, plistlib.InvalidFileException) as exc:
        raise click.ClickException(f"cannot read the {backend.kind} {backend.path}: {exc}") from None
    if path is not None:
        return LogFile(path)
    if isinstance(backend, Systemd):
        return Journal(backend)
    raise click.ClickException(f"the {backend.kind} {backend.path} sends its output nowhere (no StandardOutPath)")


# --- reading a file --------------------------------------------------------------


def tail_lines(f: BinaryIO, num_lines: int) -> bytes:
    """The last `num_lines` lines of `f`, read from its end; `f` is left at that end."""
    end = f.seek(0, os.SEEK_END)
    pos, data = end, b""
    while num_lines and pos > 0 and data.count(b"\n") <= num_lines:
        step = min(BLOCK, pos)
        pos -= step
        f.seek(pos)
        data = f.read(step) + data
    f.seek(end)
    return b"".join(data.splitlines(keepends=True)[-num_lines:]) if num_lines else b""


def follow(f: BinaryIO, path: Path, system: System, out: BinaryIO) -> None:
    """Print what is appended to `path` until Ctrl-C, across truncation and rotation (like `tail -F`)."""
    try:
        while True:
            if chunk := f.read(BLOCK):
                out.write(chunk)
                out.flush()
                continue
            f = reopened(f, path)  # only once the old file is read to its end: no line is lost
            system.sleep(POLL_S)
    finally:
        f.close()  # the file open now, which may be a reopened one


def reopened(f: BinaryIO, path: Path) -> BinaryIO:
    """`f`, rewound if `path` was truncated, or `path` opened anew if it was replaced (rotated)."""
    try:
        now = os.stat(path)
    except OSError:  # rotated away and not made again yet: keep waiting
        return f
    was = os.fstat(f.fileno())
    if (now.st_ino, now.st_dev) != (was.st_ino, was.st_dev):
        try:
            fresh = path.open("rb")
        except OSError:
            return f
        f.close()
        return fresh
    if now.st_size < f.tell():
        f.seek(0)
    return f


def open_log(log: LogFile, data_dir: Path | None) -> BinaryIO:
    """The log, open for reading; a one-line error when it is not there or not readable."""
    try:
        return log.path.open("rb")
    except FileNotFoundError:
        if log.never_ran or data_dir is None:
            raise click.ClickException(
                f"no mlxd log at {log.path}: mlxd has not run in the background here "
                "(`mlxd start` runs it; `mlxd serve` logs to its own terminal)"
            ) from None
        raise click.ClickException(f"no mlxd log at {log.path}: mlxd has not run with data dir {data_dir}") from None
    except OSError as exc:
        raise click.ClickException(f"cannot read mlxd's log {log.path}: {exc.strerror or exc}") from None


def show_file(log: LogFile, data_dir: Path | None, num_lines: int, is_following: bool, system: System) -> None:
    """Print the log's last lines, then, with -f, what comes after."""
    out = sys.stdout.buffer
    with open_log(log, data_dir) as f:
        try:
            out.write(tail_lines(f, num_lines))
            out.flush()
            if is_following:
                follow(f, log.path, system, out)
            elif f.tell() == 0:
                click.echo(f"({log.path} is empty)", err=True)
        except OSError as exc:
            if isinstance(exc, BrokenPipeError):
                raise
            raise click.ClickException(f"cannot read mlxd's log {log.path}: {exc.strerror or exc}") from None


def show_journal(journal: Journal, num_lines: int, is_following: bool, system: System) -> None:
    """`journalctl --user -u mlxd.service`, on this terminal."""
    argv = journal.unit.journal_argv(num_lines, is_following)
    code = system.run_attached(argv)
    if code == 127:
        raise click.ClickException(f"mlxd's {journal.unit.kind} logs to the journal, but `journalctl` is not installed")
    if code != 0:
        raise click.ClickException(f"`{' '.join(argv)}` failed (exit {code})")


def quiet_broken_pipe() -> None:
    """`mlxd logs | head` closed our stdout: point it at /dev/null so exiting does not complain."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


@click.command("logs")
@click.option("-f", "--follow", "is_following", is_flag=True, help="keep printing new lines as they come (Ctrl-C stops)")
@click.option("-n", "--lines", "num_lines", type=click.IntRange(min=0), default=100, show_default=True, help="how many of the last lines to print")
@data_dir_option
def logs(is_following: bool, num_lines: int, data_dir: Path | None) -> None:
    """Print the background daemon's log (its last lines; -f to follow it)."""
    system = current_system()
    try:
        log = find_log(system, data_dir)
        if isinstance(log, Journal):
            show_journal(log, num_lines, is_following, system)
        else:
            show_file(log, data_dir, num_lines, is_following, system)
    except KeyboardInterrupt:  # the way to stop -f: not an error
        pass
    except BrokenPipeError:
        quiet_broken_pipe()
