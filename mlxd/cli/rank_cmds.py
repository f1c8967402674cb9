"""`mlxd rank`: serve this host's ranks of engine groups whose supervisor runs on another host
(docs/distributed.md)."""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path

import click

from mlxd.paths import ensure_private_dir, rank_key_file
from mlxd.protocol.rank_agent import DEFAULT_PORT, read_key, split_host


@click.command("rank")
@click.option("--listen", default=f"0.0.0.0:{DEFAULT_PORT}", show_default=True, metavar="IP:PORT",
              help="where supervisors connect: this host's address on the link the ranks share")
@click.option("--key-file", type=click.Path(path_type=Path), default=None,
              help="the key every host of the group holds [default: rank.key in mlxd's data dir]")
@click.option("--new-key", is_flag=True, help="write a new random key to the key file, then exit (copy it to "
                                              "the supervisor's host, same place)")
@click.option("--memory-gb", type=click.FloatRange(min=0, min_open=True), default=None,
              help="the most memory this host gives ranks, in GB [default: what it has free]")
@click.option("--force", is_flag=True, help="with --new-key: replace a key file that exists (every host must "
                                            "then get the new one)")
def rank(listen: str, key_file: Path | None, memory_gb: float | None, new_key: bool, force: bool) -> None:
    """Start ranks of engine groups for a supervisor on another host that holds the same key."""
    from mlxd.cli.serve_cmds import start_logging

    path = key_file or rank_key_file()
    if force and not new_key:
        raise click.UsageError("--force goes with --new-key")
    if new_key:
        write_key(path, force)
        click.echo(f"wrote a new key to {path}; copy it to the same place on every host of the group")
        return
    try:
        read_key(path)
    except FileNotFoundError:
        raise click.ClickException(f"no key at {path}: run `mlxd rank --new-key` on one host and copy the file "
                                   "to the others") from None
    except (OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        host, port = split_host(listen)
    except ValueError:
        raise click.ClickException(f"--listen {listen!r}: give IP:PORT") from None
    start_logging()
    from mlxd.agent.rank import run

    try:
        asyncio.run(run(host, port, path, int(memory_gb * 1e9) if memory_gb is not None else None))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {listen}: {exc}") from None


def write_key(path: Path, force: bool) -> None:
    """A new random key at `path` (mode 0600). One there already is kept unless `force`: the
    other hosts hold it, and replacing it would lock them out until they get the new one."""
    ensure_private_dir(path.parent)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise click.ClickException(f"{path} already holds a key (the group's hosts share it); "
                                   "`mlxd rank --new-key --force` replaces it") from None
    except OSError as exc:
        raise click.ClickException(f"cannot write {path}: {exc}") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # a file made with another mode before, replaced with --force
        f.write(secrets.token_hex(32) + "\n")
