"""What an admin or a lease asks of the pool: load, unload and drain a model; hold one for a lease.

The pool's own seam is the queue and its replans (pool.py); these verbs act through it, so a
load waits in the queue like a request and a hold changes only what the next replan sees.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mlxd.protocol.engine_state import EngineState
from mlxd.protocol.errors import APIError
from mlxd.protocol.process import DrainResult
from mlxd.supervisor.registry import ModelEntry

if TYPE_CHECKING:
    from mlxd.supervisor.engines.pool import Pool, Slot


class PoolAdmin:
    """The admin routes' and the leases' verbs on one pool."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    async def load(self, entry: ModelEntry, pin: bool | None = None) -> Slot:
        """Start the model's engine (as the policy allows) and wait until it is READY."""
        pool = self._pool
        slot = pool.slot_for(entry)
        await slot.engine.reset()
        if pin is not None:
            slot.pinned = pin
        pool.release(await pool.acquire(entry, timeout_s=pool.admin_wait_s()))
        return slot

    async def unload(self, slot: Slot) -> DrainResult | None:
        """Drain (bounded), then stop the engine; its drain report."""
        slot.closing = "unloaded by an admin"
        self._pool.schedule_replan()
        await asyncio.shield(self._pool.retire(slot))
        return slot.last_drain

    async def drain(self, slot: Slot) -> DrainResult | None:
        """Drain a READY engine and keep it serving; the engine's report (None if not READY)."""
        if slot.engine.state is not EngineState.READY:
            return None
        return await slot.engine.drain(self._pool.config.drain_timeout_s)

    async def hold(self, entry: ModelEntry, lease_id: str, on_lost: Callable[[str], None]) -> Slot:
        """Bring the model up and hold it for a lease: only `lease_id`'s requests run on it."""
        pool = self._pool
        slot = pool.slot_for(entry)
        if slot.lease_id is not None:
            raise APIError(409, f"Model {entry.id} is already leased.", code="lease_conflict")
        await slot.engine.reset()
        await pool.acquire(entry, timeout_s=pool.admin_wait_s())
        slot.in_flight -= 1  # the lease itself is not a request in flight
        slot.lease_id, slot.on_lease_lost = lease_id, on_lost
        pool.schedule_replan()
        return slot

    def unhold(self, slot: Slot) -> None:
        """The lease on this model ended."""
        slot.lease_id, slot.on_lease_lost, slot.engine_lease_token = None, None, None
        slot.last_used, slot.last_used_wall = self._pool.clock(), time.time()
        self._pool.schedule_replan()
