"""When the pool refills its spare engine: once it has been quiet a moment (a spare's imports
would slow work in flight), and later after spares that died young."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from mlxd.supervisor.engines import policy
from mlxd.supervisor.engines.spare import Spare

SPARE_AFTER_QUIET_S = 1.0  # the pool quiet this long: refill the spare


class SpareTiming:
    """The spare's refill timer; `is_quiet` says whether the pool has nothing queued, in
    flight or starting (the pool's replan calls `arm` after every change)."""

    def __init__(self, spare: Spare, is_quiet: Callable[[], bool], quiet_s: float = SPARE_AFTER_QUIET_S) -> None:
        self.spare = spare
        self._is_quiet = is_quiet
        self._quiet_s = quiet_s
        self._timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        """A refill after the quiet delay (backed off), or none while the pool is busy."""
        if not self._is_quiet():
            self.disarm()
        elif self._timer is None:
            delay = policy.spare_delay_s(self.spare.num_young_deaths, self._quiet_s)
            self._timer = asyncio.get_running_loop().call_later(delay, self._refill)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _refill(self) -> None:
        self._timer = None
        if self._is_quiet():
            self.spare.refill()
