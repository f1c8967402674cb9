"""Placeholder while being built (issue 14)."""

import click


@click.command("logs")
def logs() -> None:
    """Not built yet."""
    raise click.ClickException("not built yet")
