"""`mlxd pull` and `mlxd rm`: fetch a model from the Hugging Face hub, delete one mlxd owns.

`pull` imports huggingface_hub only when run; `rm` never does (nor aiohttp, nor mlx).
"""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from mlxd import paths
from mlxd.cli.admin.client import AdminError, Unreachable
from mlxd.cli.admin.cmds import daemon_options, describe_failure, make_client
from mlxd.cli.options import data_dir_option
from mlxd.hub.pull_record import PullRecord
from mlxd.hub.removal import RemovalError, removal_target, remove_model, tree_bytes
from mlxd.protocol.units import format_size

if TYPE_CHECKING:
    from mlxd.hub.puller import PullResult, RemoteFile
    from mlxd.supervisor.registry import ModelEntry, Registry

EXIT_INTERRUPTED = 130


class PullLines:
    """Pull progress on stderr: huggingface_hub's bars on a terminal, a plain line per file otherwise."""

    def __init__(self, is_tty: bool) -> None:
        self.is_tty = is_tty

    def started(self, repo: str, revision: str, commit: str, files: list[RemoteFile]) -> None:
        total = sum(f.size or 0 for f in files)
        click.echo(f"pulling {repo}@{revision} (commit {commit[:12]}): {len(files)} files, {format_size(total)}",
                   err=True)

    def fetching(self, file: RemoteFile, is_cached: bool) -> None:
        if is_cached:
            click.echo(f"  {file.name}: already here", err=True)
        elif not self.is_tty:  # on a terminal the file's own bar names it
            click.echo(f"  {file.name}: fetching {format_size(file.size)}", err=True)

    def resuming(self, file: RemoteFile, num_fetched: int, why: str | None) -> None:
        because = f" ({why})" if why else ""
        click.echo(f"  {file.name}: resuming at {format_size(num_fetched)} of {format_size(file.size)}{because}",
                   err=True)

    def fetched(self, file: RemoteFile) -> None:
        pass

    def warn(self, text: str) -> None:
        click.echo(f"warning: {text}", err=True)


@click.command("pull")
@click.argument("spec", metavar="REPO[@REVISION]")
@data_dir_option
def pull(spec: str, data_dir: Path | None) -> None:
    """Download an MLX model from the Hugging Face hub into the hub cache mlxd serves from."""
    from mlxd.hub.puller import Puller, PullError, PullInterrupted, parse_spec
    from mlxd.supervisor.registry import hf_cache_dir

    # huggingface_hub logs through a handler of its own; the root's would print each warning twice.
    logging.getLogger("huggingface_hub").propagate = False
    puller = Puller(hf_cache_dir(), PullRecord(data_dir or paths.data_dir()), PullLines(sys.stderr.isatty()))
    try:
        result = puller.pull(*parse_spec(spec))
    except PullError as exc:
        raise click.ClickException(str(exc)) from None
    except PullInterrupted as exc:  # in the middle of a file whose partial download is kept
        click.echo(f"\ninterrupted: {exc}", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except KeyboardInterrupt:
        click.echo("\ninterrupted: run the same command again to go on (the files already fetched are kept)",
                   err=True)
        sys.exit(EXIT_INTERRUPTED)
    report_pull(result)


def report_pull(result: PullResult) -> None:
    """Where the model went and how to run it: the id on stdout, the rest on stderr."""
    if result.is_offline:
        click.echo(f"{result.repo}@{result.revision} is already in the hub cache (HF_HUB_OFFLINE is set)", err=True)
    else:
        click.echo(f"pulled {result.repo}@{result.revision}: {format_size(result.num_fetched_bytes)} fetched, "
                   f"in {result.snapshot}", err=True)
    if result.model_id is None:
        click.echo(f"warning: mlxd does not list {result.repo}: {result.snapshot} is not an MLX model dir "
                   "(config.json and *.safetensors)", err=True)
        return
    if not result.is_served_snapshot:
        click.echo(f"note: mlxd serves {result.model_id} from refs/main's snapshot, not this one", err=True)
    click.echo(result.model_id)
    click.echo(f"run it: mlxd run {shlex.quote(result.model_id)}", err=True)


# --- rm ----------------------------------------------------------------------------------


@click.command("rm")
@click.argument("model")
@click.option("-y", "--yes", is_flag=True, help="do not ask for confirmation")
@daemon_options
def rm(model: str, yes: bool, url: str | None, config_file: Path | None, data_dir: Path | None) -> None:
    """Delete MODEL: one in mlxd's models dir, or one `mlxd pull` put in the hub cache."""
    from mlxd.supervisor.registry import Registry, hf_cache_dir

    root = data_dir or paths.data_dir()
    cache = hf_cache_dir()
    entry = find_entry(Registry({}, models_dir=paths.models_dir(root), hf_cache=cache), model)
    record = PullRecord(root)
    try:
        target = removal_target(entry, record, cache)
        refuse_if_loaded(entry.id, url, config_file, data_dir)
        if not yes and sys.stdin.isatty():
            click.confirm(f"Remove {entry.id} ({format_size(tree_bytes(target))}, {target})?", abort=True, err=True)
        target, num_bytes = remove_model(entry, record, cache)
    except RemovalError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"removed {entry.id} ({target}): {format_size(num_bytes)} freed")


def find_entry(registry: Registry, model: str) -> ModelEntry:
    """The registry's entry with exactly this id, else a one-line error naming what exists."""
    from mlxd.protocol.errors import APIError

    if (entry := registry.get(model)) is not None:
        return entry
    try:
        near = registry.resolve(model)
    except APIError as exc:
        raise click.ClickException(exc.message) from None
    # A destructive command takes the exact id, not the short or case-folded names requests may use.
    raise click.ClickException(f"no model '{model}'; did you mean '{near.id}'? (`mlxd rm` takes the exact id)")


def refuse_if_loaded(model_id: str, url: str | None, config_file: Path | None, data_dir: Path | None) -> None:
    """An error if a running mlxd has an engine on the model; nothing if no mlxd runs."""
    client = make_client(url, config_file, data_dir)
    try:
        listing = client.get("/admin/engines")
    except Unreachable:
        return
    except AdminError as exc:
        raise click.ClickException(
            f"cannot check whether mlxd has {model_id} loaded: {describe_failure(exc, client)}"
        ) from None
    if any(e.get("model") == model_id and e.get("state") != "stopped" for e in listing.get("data", [])):
        raise click.ClickException(f"mlxd has {model_id} loaded; unload it first: mlxd unload {shlex.quote(model_id)}")
