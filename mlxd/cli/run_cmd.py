"""Placeholder while being built (issue 14)."""

import click


@click.command("run")
def run() -> None:
    """Not built yet."""
    raise click.ClickException("not built yet")
