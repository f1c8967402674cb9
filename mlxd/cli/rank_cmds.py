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
def rank(listen: str, key_file: Path | None, new_key: bool) -> None:
    """Start ranks of engine groups for a supervisor on another host that holds the same key."""
    from mlxd.cli.serve_cmds import start_logging

    path = key_file or rank_key_file()
    if new_key:
        ensure_private_dir(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
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
        asyncio.run(run(host, port, path))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {listen}: {exc}") from None
