"""`mlxd serve` (the supervisor, in the foreground) and `mlxd engine` (one engine, for debugging)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from mlxd import paths
from mlxd.cli.options import serve_options
from mlxd.paths import DEFAULT_MODEL_ID, ensure_private_dir, models_dir, runtime_dir


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


def start_logging() -> None:
    """Log to stderr in $MLXD_LOG_FORMAT (set by --log-format) at $MLXD_LOG_LEVEL."""
    from mlxd.logformat import setup_logging

    level = os.environ.get("MLXD_LOG_LEVEL") or "INFO"
    try:
        setup_logging(os.environ.get("MLXD_LOG_FORMAT") or "text", level.upper())
    except ValueError as exc:  # an unknown level; the format was checked by its option
        raise click.ClickException(f"$MLXD_LOG_LEVEL: {exc}") from None


@click.command("serve")
@serve_options
@click.option("--insecure-no-auth", is_flag=True, help="allow a non-loopback bind with no API keys")
def serve(host: str | None, port: int | None, config_file: Path | None, data_dir: Path | None, insecure_no_auth: bool) -> None:
    """Run the mlxd supervisor in the foreground: OpenAI API on TCP, one engine per model."""
    from mlxd.supervisor.quick_import import import_aiohttp

    import_aiohttp()  # first, before any module below imports it

    from mlxd.supervisor.config import (
        ConfigError,
        apply_overrides,
        config_path,
        is_explicit_config,
        load_config,
    )
    from mlxd.supervisor.http.auth import check_bind
    from mlxd.supervisor.server import serve as run_server

    if data_dir is not None:
        os.environ["MLXD_DATA_DIR"] = str(data_dir.expanduser().resolve())
    start_logging()
    try:
        named = str(config_file) if config_file else None
        config = apply_overrides(load_config(config_path(named), explicit=is_explicit_config(named)), host=host, port=port)
        server = config.server
        check_bind(server.host, bool(server.api_keys or server.admin_keys), insecure_no_auth or server.insecure_no_auth)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(run_server(config, paths.data_dir()))  # sees --data-dir through MLXD_DATA_DIR


@click.command("engine")
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
