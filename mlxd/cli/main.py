"""The `mlxd` command.

Subcommands are imported only when run: `mlxd serve` is on the supervisor's start-up path, and
each import it skips is start-up time saved.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import click

from mlxd import __version__
from mlxd.paths import PrivateDirError

# name -> "module:attribute", in the order `mlxd --help` lists them.
COMMANDS = {
    "run": "mlxd.cli.chat.run_cmd:run",
    "serve": "mlxd.cli.serve_cmds:serve",
    "start": "mlxd.cli.service.cmds:start",
    "stop": "mlxd.cli.service.cmds:stop",
    "status": "mlxd.cli.service.cmds:status",
    "logs": "mlxd.cli.service.logs_cmd:logs",
    "service": "mlxd.cli.service.cmds:service",
    "models": "mlxd.cli.admin.cmds:models",
    "ps": "mlxd.cli.admin.cmds:ps",
    "load": "mlxd.cli.admin.cmds:load",
    "unload": "mlxd.cli.admin.cmds:unload",
    "drain": "mlxd.cli.admin.cmds:drain",
    "lease": "mlxd.cli.admin.cmds:lease",
    "adapters": "mlxd.cli.admin.adapter_cmds:adapters",
    "finetune": "mlxd.cli.admin.lab_cmds:finetune",
    "quantize": "mlxd.cli.admin.lab_cmds:quantize",
    "fuse": "mlxd.cli.admin.lab_cmds:fuse",
    "merge": "mlxd.cli.admin.lab_cmds:merge",
    "dataset": "mlxd.cli.admin.lab_data_cmds:dataset",
    "push": "mlxd.cli.admin.lab_data_cmds:push",
    "jobs": "mlxd.cli.admin.lab_cmds:jobs",
    "login": "mlxd.cli.admin.lab_data_cmds:login",
    "logout": "mlxd.cli.admin.lab_data_cmds:logout",
    "pull": "mlxd.cli.pull_cmds:pull",
    "rm": "mlxd.cli.pull_cmds:rm",
    "import-default": "mlxd.cli.import_cmds:import_default",
    "import-gguf": "mlxd.cli.import_cmds:import_gguf",
    "engine": "mlxd.cli.serve_cmds:engine",
    "rank": "mlxd.cli.rank_cmds:rank",
}


class LazyGroup(click.Group):
    """A click group that imports a subcommand's module only when that subcommand is used."""

    def __init__(self, *args: object, lazy: dict[str, str], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*self.lazy, *sorted(set(super().list_commands(ctx)) - set(self.lazy))]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = self.lazy.get(cmd_name)
        if target is None:
            return super().get_command(ctx, cmd_name)
        module, attr = target.split(":")
        command = getattr(importlib.import_module(module), attr)
        assert isinstance(command, click.Command), target
        return command

    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand; a runtime dir that is not private is one line and exit 1, not a traceback."""
        try:
            return super().invoke(ctx)
        except PrivateDirError as exc:
            raise click.ClickException(str(exc)) from None


class CliLogFormatter(logging.Formatter):
    """`warning: ...`, as a command line tool says it (the daemon's log has its own format)."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {super().format(record)}"


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlxd")
@click.pass_context
def main(ctx: click.Context) -> None:
    """mlxd: a local LLM inference daemon on MLX."""
    if ctx.invoked_subcommand not in ("serve", "rank"):  # daemons log with timestamps, to stderr or their log
        handler = logging.StreamHandler()
        handler.setFormatter(CliLogFormatter())
        logging.basicConfig(level=logging.WARNING, handlers=[handler])
