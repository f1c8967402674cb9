"""A lease on the whole machine: every engine stopped, and none started, while a job runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from mlxd.protocol.errors import APIError


class MachineHold:
    """Whether the machine is leased; the pool's replan calls `engines_gone` once none is live."""

    def __init__(self, on_change: Callable[[], None], stop_spare: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._on_change = on_change  # the pool replans: the policy stops every engine while held
        self._stop_spare = stop_spare
        self.is_held = False
        self._free = asyncio.Event()

    async def acquire(self) -> None:
        """Hold the machine, and return once every engine has stopped (drained first)."""
        if self.is_held:
            raise APIError(409, "The machine is already leased.", code="lease_conflict")
        self.is_held = True
        self._free.clear()
        self._on_change()
        await self._stop_spare()  # the job gets the whole machine: no engine process at all
        try:
            await self._free.wait()
        except asyncio.CancelledError:
            self.release()
            raise

    def release(self) -> None:
        self.is_held = False
        self._on_change()

    def engines_gone(self) -> None:
        """No engine is live any more: a held machine is free for its job."""
        if self.is_held:
            self._free.set()
