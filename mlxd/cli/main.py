"""The `mlxd` command."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from mlxd import __version__
from mlxd.cli.import_cmds import import_default, import_gguf
from mlxd.paths import DEFAULT_MODEL_ID, ensure_private_dir, models_dir, runtime_dir


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlxd")
def main() -> None:
    """mlxd: a local LLM inference daemon on MLX."""


main.add_command(import_gguf)
main.add_command(import_default)


def resolve_model(model: str) -> tuple[Path, str]:
    """A model dir and its id, from a path or an id in mlxd's models dir."""
    as_path = Path(model).expanduser()
    if as_path.is_dir():
        return as_path.resolve(), as_path.name
    candidate = models_dir() / model
    if candidate.is_dir():
        return candidate, model
    known = sorted(p.name for p in models_dir().glob("*") if (p / "config.json").is_file())
    hint = f" Known models: {', '.join(known)}." if known else " Run `mlxd import-default` first."
    raise click.ClickException(f"No model {model!r}: not a dir and not in {models_dir()}.{hint}")


@main.command("engine")
@click.argument("model", default=DEFAULT_MODEL_ID)
@click.option("--socket", "socket_path", type=click.Path(path_type=Path), help="Unix socket (default: in mlxd's runtime dir)")
@click.option("--max-context", type=click.IntRange(min=1), help="cap the context window (tokens)")
def engine(model: str, socket_path: Path | None, max_context: int | None) -> None:
    """Serve one MODEL (an id in the models dir, or a path) on a Unix socket, in the foreground."""
    model_dir, model_id = resolve_model(model)
    if socket_path is None:
        socket_path = ensure_private_dir(runtime_dir()) / f"{model_id[:60]}.sock"
    click.echo(f"mlxd engine: serving {model_id} on {socket_path}", err=True)
    click.echo(
        f"  try: curl --unix-socket {socket_path} http://mlxd/v1/chat/completions "
        f"-d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
        err=True,
    )
    argv = [sys.executable, "-m", "mlxd.engine", "--model", str(model_dir), "--model-id", model_id, "--socket", str(socket_path)]
    if max_context:
        argv += ["--max-context", str(max_context)]
    os.execv(sys.executable, argv)
