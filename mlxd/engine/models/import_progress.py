"""What an import reports as it goes: plain events, so that the CLI chooses how to show them."""

from __future__ import annotations

from collections.abc import Callable

import msgspec


class Phase(msgspec.Struct, frozen=True, tag=True):
    """A new step; `total` in `unit`s ("bytes", "tensors") when its length is known, else None."""

    message: str
    total: int | None = None
    unit: str = ""


class Advance(msgspec.Struct, frozen=True, tag=True):
    """How many units of the current step are done so far."""

    done: int


ProgressEvent = Phase | Advance
Progress = Callable[[ProgressEvent], None]


def ignore(_event: ProgressEvent) -> None:
    """A `Progress` that shows nothing."""
