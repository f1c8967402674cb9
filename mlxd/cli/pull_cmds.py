"""Placeholder while being built (issue 14)."""

import click


@click.command("pull")
def pull() -> None:
    """Not built yet."""
    raise click.ClickException("not built yet")


@click.command("rm")
def rm() -> None:
    """Not built yet."""
    raise click.ClickException("not built yet")
