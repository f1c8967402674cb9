"""Click options shared by `mlxd serve`, `start` and `service install`."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import click
from click.core import ParameterSource

from mlxd.logformat import LOG_FORMATS

data_dir_option = click.option(
    "--data-dir", type=click.Path(path_type=Path),
    help="models, caches, logs and the pid file (default: $MLXD_DATA_DIR, else the platform data dir)",
)
host_option = click.option("--host", help="address to listen on (default 127.0.0.1)")
port_option = click.option("--port", type=click.IntRange(1, 65535), help="TCP port (default 8800)")
config_option = click.option(
    "--config", "config_file", type=click.Path(path_type=Path),
    help="TOML config file (default: $MLXD_CONFIG, else the platform config dir)",
)


def export_log_format(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Check --log-format/$MLXD_LOG_FORMAT and put it in $MLXD_LOG_FORMAT, where the daemon reads it.

    Through the environment, it reaches a detached `mlxd serve` (which inherits it) and the
    installed service (whose env is written from it) with no change to those commands' options.
    """
    if not value:
        return None
    if value.lower() not in LOG_FORMATS:
        where = "$MLXD_LOG_FORMAT" if ctx.get_parameter_source("log_format") == ParameterSource.ENVIRONMENT else None
        raise click.BadParameter(f"{value!r} is not one of {', '.join(LOG_FORMATS)}", ctx, param, where)
    os.environ["MLXD_LOG_FORMAT"] = value.lower()
    return value.lower()


log_format_option = click.option(
    "--log-format", envvar="MLXD_LOG_FORMAT", expose_value=False, callback=export_log_format,
    metavar="[text|json]", help="the daemon's log lines: text, or one JSON object a line (default: $MLXD_LOG_FORMAT, else text)",
)


def serve_options(command: Callable[..., None]) -> Callable[..., None]:
    """--host, --port, --config, --data-dir and --log-format: how the daemon's `mlxd serve` is run."""
    for option in (log_format_option, data_dir_option, config_option, port_option, host_option):
        command = option(command)
    return command
