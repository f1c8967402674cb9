"""Click options shared by `mlxd serve`, `start` and `service install`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

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


def serve_options(command: Callable[..., None]) -> Callable[..., None]:
    """--host, --port, --config and --data-dir: how the daemon's `mlxd serve` is run."""
    for option in (data_dir_option, config_option, port_option, host_option):
        command = option(command)
    return command
