"""How far a model load has got, written by the GPU thread and read by `/health`."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Literal, TypeVar

from mlxd.protocol.stats import LoadPhase, LoadProgress

T = TypeVar("T")


class LoadMeter:
    """The load's phase and count. The GPU thread replaces `_now` whole, so a reader on the
    event loop never sees a half-written progress (one reference assignment)."""

    def __init__(self) -> None:
        self._now: LoadProgress | None = None
        self._phase_started = time.monotonic()

    def begin(self, phase: LoadPhase, total: int | None = None, unit: Literal["bytes"] | None = None) -> None:
        """A new phase, `total` units to go (None: unknown)."""
        self._phase_started = time.monotonic()
        self._now = LoadProgress(phase, 0, total, unit)

    def advance(self, amount: int) -> None:
        """`amount` more units of the current phase are done."""
        if (now := self._now) is not None:
            self._now = LoadProgress(now.phase, now.done + amount, now.total, now.unit)

    def each(self, phase: LoadPhase, items: Iterable[T], total: int | None = None) -> Iterator[T]:
        """`items`, counting each one as a step of `phase` once it has been handled."""
        self.begin(phase, total)
        for item in items:
            yield item
            self.advance(1)

    def end(self) -> None:
        """Loaded (or failed): nothing to report."""
        self._now = None

    def snapshot(self) -> LoadProgress | None:
        """The progress now, with the phase's elapsed time."""
        if (now := self._now) is None:
            return None
        elapsed = round(time.monotonic() - self._phase_started, 3)
        return LoadProgress(now.phase, now.done, now.total, now.unit, elapsed)
