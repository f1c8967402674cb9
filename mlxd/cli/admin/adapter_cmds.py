"""`mlxd adapters [load|unload]`: LoRA adapters on the daemon (its /v1/adapters routes)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import click

from mlxd.cli.admin.cmds import daemon_options, emit, failures_as_click, json_option, make_client
from mlxd.cli.admin.tables import format_size, render_table


def adapters_text(listing: Mapping[str, Any]) -> str:
    """The adapters table: id, base model, kind and rank, size, where loaded."""
    rows = [(a["id"], a.get("base_model") or "-", f"{a.get('kind', 'lora')} r{a.get('rank', 0)}",
             format_size(a.get("size_bytes")), ",".join(a.get("loaded_on") or []) or "-")
            for a in listing.get("data", [])]
    if not rows:
        return ("no adapters found (put mlx-lm adapter dirs in the data dir's adapters/, "
                "or `mlxd adapters load PATH`)")
    return render_table(("ADAPTER", "BASE MODEL", "KIND", "SIZE", "LOADED ON"), rows)


def loaded_text(adapter: Mapping[str, Any]) -> str:
    return f"adapter {adapter['id']} loaded on {', '.join(adapter.get('loaded_on') or ['-'])}"


def unloaded_text(answer: Mapping[str, Any]) -> str:
    return f"adapter {answer['id']} unloaded from {', '.join(answer.get('unloaded_from') or ['-'])}"


@click.group("adapters", invoke_without_command=True)
@click.option("--model", help="only the adapters made for this model")
@json_option
@daemon_options
@click.pass_context
def adapters(ctx: click.Context, model: str | None, as_json: bool, url: str | None, config_file: Path | None,
             data_dir: Path | None) -> None:
    """List the LoRA adapters mlxd knows and where each is loaded (GET /v1/adapters).

    A request picks adapters by its `adapter` field ("name", "a+b" to stack them, "none"), or
    by a model id of the form MODEL:ADAPTER.
    """
    if ctx.invoked_subcommand is not None:
        return
    client = make_client(url, config_file, data_dir)
    path = f"/v1/adapters/available?model={quote(model)}" if model else "/v1/adapters"
    with failures_as_click(client):
        emit(client.get(path), as_json, adapters_text)


@adapters.command("load")
@click.argument("adapter")
@click.option("--model", help="the model to load it on (default: the base model its config names)")
@click.option("--id", "adapter_id", help="the name to serve a dir under (default: the dir's name)")
@json_option
@daemon_options
def load(adapter: str, model: str | None, adapter_id: str | None, as_json: bool, url: str | None,
         config_file: Path | None, data_dir: Path | None) -> None:
    """Load ADAPTER (a name mlxd knows, or the path of an adapter dir) and keep it loaded."""
    client = make_client(url, config_file, data_dir)
    is_path = os.sep in adapter or adapter.startswith(".") or Path(adapter).is_dir()
    body: dict[str, Any] = ({"path": str(Path(adapter).expanduser().resolve())} if is_path else {"id": adapter})
    if adapter_id:
        body["id"] = adapter_id
    if model:
        body["model"] = model
    with failures_as_click(client):
        emit(client.post("/v1/adapters", body, timeout=None), as_json, loaded_text)


@adapters.command("unload")
@click.argument("adapter")
@json_option
@daemon_options
def unload(adapter: str, as_json: bool, url: str | None, config_file: Path | None, data_dir: Path | None) -> None:
    """Unload ADAPTER from every model (requests running under it finish first)."""
    client = make_client(url, config_file, data_dir)
    with failures_as_click(client):
        emit(client.delete(f"/v1/adapters/{quote(adapter, safe='')}"), as_json, unloaded_text)
