"""`mlxd dataset`, `mlxd push`, `mlxd login`, `mlxd logout`: the lab's data and the hub, from the shell.

`mlxd dataset` and `mlxd push` queue jobs on the daemon (/lab routes; `--wait` follows them as
`mlxd finetune --wait` does). `mlxd login` keeps a Hugging Face token in the data dir (mode
0600) without needing the daemon: it asks for the token without echoing it, or reads it from
stdin, so it never lands in the shell's history or the process list.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from mlxd.cli.admin.cmds import daemon_options, emit, failures_as_click, json_option, make_client
from mlxd.cli.admin.lab_cmds import submitted
from mlxd.cli.admin.tables import render_table
from mlxd.cli.options import data_dir_option


def _inputs(pairs: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--input")
        out[key] = int(value) if value.isdigit() else value
    return out


def templates_text(listing: dict[str, Any]) -> str:
    rows = []
    for t in listing.get("data", []):
        inputs = ", ".join(f"{i['name']}{'' if i.get('required') else '?'}" for i in t["inputs"])
        rows.append((t["id"], t["format"], inputs, t["description"]))
    return render_table(("TEMPLATE", "FORMAT", "INPUTS (? optional)", "MAKES"), rows)


@click.command("dataset")
@click.argument("template", required=False)
@click.argument("model", required=False)
@click.option("--name", help="the dataset's name (its dir in the datasets dir)")
@click.option("--rows", type=click.IntRange(min=2), default=100, show_default=True)
@click.option("-i", "--input", "inputs", multiple=True, metavar="KEY=VALUE", help="a template input (repeat)")
@click.option("--temperature", type=click.FloatRange(0, 2), default=0.9, show_default=True)
@click.option("--templates", "list_templates", is_flag=True, help="list the templates and their inputs")
@click.option("--wait", is_flag=True, help="follow the job until it ends; exit non-zero if it fails")
@json_option
@daemon_options
def dataset(template: str | None, model: str | None, name: str | None, rows: int, inputs: tuple[str, ...],
            temperature: float, list_templates: bool, wait: bool, as_json: bool, url: str | None,
            config_file: Path | None, data_dir: Path | None) -> None:
    """Make a fine-tune dataset: MODEL (served by mlxd) writes ROWS rows by TEMPLATE.

    \b
    mlxd dataset --templates
    mlxd dataset qa SmolLM2-135M-Instruct --name tides -i topic="ocean tides" --rows 200 --wait
    """
    client = make_client(url, config_file, data_dir)
    with failures_as_click(client):
        if list_templates:
            emit(client.get("/lab/dataset/templates"), as_json, templates_text)
            return
        if not template or not model or not name:
            raise click.UsageError("expected: mlxd dataset TEMPLATE MODEL --name NAME (or --templates)")
        body = {"template": template, "model": model, "name": name, "rows": rows, "inputs": _inputs(inputs),
                "temperature": temperature}
        submitted(client, client.post("/lab/dataset", body), wait, as_json)


@click.command("push")
@click.argument("kind", type=click.Choice(["model", "adapter", "dataset"]))
@click.argument("name")
@click.argument("repo_id", metavar="OWNER/REPO")
@click.option("--private", is_flag=True, help="make the repo private (when it is made)")
@click.option("--message", help="the commit message")
@click.option("--wait", is_flag=True, help="follow the job until it ends; exit non-zero if it fails")
@json_option
@daemon_options
def push(kind: str, name: str, repo_id: str, private: bool, message: str | None, wait: bool, as_json: bool,
         url: str | None, config_file: Path | None, data_dir: Path | None) -> None:
    """Upload the model, adapter or dataset NAME to the Hugging Face hub as OWNER/REPO (`mlxd login` first)."""
    client = make_client(url, config_file, data_dir)
    body: dict[str, Any] = {"kind": kind, "name": name, "repo_id": repo_id, "private": private}
    if message:
        body["commit_message"] = message
    with failures_as_click(client):
        submitted(client, client.post("/lab/push", body), wait, as_json)


def _token_file(data_dir: Path | None) -> Path:
    from mlxd.cli.service.cmds import resolve_data_dir
    from mlxd.cli.service.spec import ServeOptions
    from mlxd.paths import hf_token_file

    return hf_token_file(resolve_data_dir(ServeOptions(data_dir=data_dir)))


@click.command("login")
@data_dir_option
def login(data_dir: Path | None) -> None:
    """Keep a Hugging Face token (for `mlxd push`) in the data dir, readable by you alone.

    It is asked for without echo, or read from stdin: `mlxd login < token.txt`."""
    from mlxd.supervisor.lab_files import check_token, write_private

    if sys.stdin.isatty():
        raw = click.prompt("Hugging Face token (https://huggingface.co/settings/tokens)", hide_input=True)
    else:
        raw = sys.stdin.readline()
    try:
        token = check_token(raw)
    except ValueError as exc:
        raise click.ClickException(str(exc).replace("`token`", "the token")) from None
    path = _token_file(data_dir)
    write_private(path, token + "\n")
    click.echo(f"token saved to {path} (mode 0600); `mlxd logout` removes it")


@click.command("logout")
@data_dir_option
def logout(data_dir: Path | None) -> None:
    """Remove the Hugging Face token `mlxd login` kept."""
    path = _token_file(data_dir)
    try:
        path.unlink()
    except FileNotFoundError:
        click.echo(f"no token kept ({path} does not exist)")
        return
    click.echo(f"token removed ({path})")
