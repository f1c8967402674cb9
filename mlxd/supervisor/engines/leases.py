"""Job leases: a model, or the whole machine, held for a tool (a benchmark, a fine-tune) a while.

A model lease brings the model's engine up, keeps every other request for it queued (requests
with the lease's id in `X-MLXD-Lease` still run), and holds the engine's own exclusive
execution lease: its `POST /admin/lease` stream, open for as long as the lease lasts. A machine
lease (`model: null`) stops every engine and lets none start. A lease ends on DELETE, on
expiry (enforced by a timer here, whether or not the holder is still around), or when its
engine dies; ended leases stay listed a while, with the reason.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import msgspec

from mlxd.protocol.errors import APIError
from mlxd.protocol.process import LEASE_PATH, LeaseLine, LeaseRequest
from mlxd.protocol.supervisor_api import Lease
from mlxd.supervisor.engines.pool import Pool, Slot
from mlxd.supervisor.engines.upstream import Upstream, open_upstream
from mlxd.supervisor.registry import ModelEntry

log = logging.getLogger("mlxd.supervisor")
_lease_line = msgspec.json.Decoder(LeaseLine)
NUM_ENDED_KEPT = 50
ENGINE_LEASE_WAIT_S = 300.0


@dataclass(eq=False)
class _Hold:
    lease: Lease
    slot: Slot | None  # None: the machine
    expiry: asyncio.TimerHandle | None = None
    engine_stream: Upstream | None = None
    watcher: asyncio.Task[None] | None = None


class Leases:
    """The leases held now, and the last ones that ended."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._held: dict[str, _Hold] = {}
        self._ended: collections.deque[Lease] = collections.deque(maxlen=NUM_ENDED_KEPT)
        self._tasks: set[asyncio.Task[None]] = set()

    def all(self) -> list[Lease]:
        """Held leases first, then ended ones, newest first."""
        return [h.lease for h in self._held.values()] + list(reversed(self._ended))

    def get(self, lease_id: str) -> Lease:
        """A held lease; 404 otherwise."""
        hold = self._held.get(lease_id)
        if hold is None:
            raise _not_found(lease_id)
        return hold.lease

    def for_model(self, model_id: str) -> Lease | None:
        """The lease holding this model, if any."""
        return next((h.lease for h in self._held.values() if h.lease.model == model_id), None)

    async def take(self, entry: ModelEntry | None, ttl_s: float, holder: str) -> Lease:
        """Hold a model (or, with None, the machine); returns once held."""
        now = time.time()
        lease = Lease(id=f"lease_{secrets.token_hex(8)}", model=entry.id if entry else None, holder=holder,
                      ttl_s=ttl_s, created_at=now, expires_at=now + ttl_s)
        if entry is None:
            await self._pool.machine.acquire()
            hold = _Hold(lease, None)
        else:
            slot = await self._pool.admin.hold(entry, lease.id, self._on_engine_lost)
            hold = _Hold(lease, slot)
            try:
                await self._hold_engine(hold)
            except BaseException:
                self._pool.admin.unhold(slot)
                raise
        lease.expires_at = time.time() + ttl_s  # the wait to get it does not eat into it
        self._held[lease.id] = hold
        self._arm(hold)
        log.info("lease %s held: %s for %r, %.0f s", lease.id, lease.model or "the machine", holder, ttl_s)
        return lease

    def renew(self, lease_id: str, ttl_s: float | None) -> Lease:
        """Push the expiry out by `ttl_s` (default: the lease's own) from now."""
        hold = self._held.get(lease_id)
        if hold is None:
            raise _not_found(lease_id)
        if ttl_s is not None:
            hold.lease.ttl_s = ttl_s
        hold.lease.expires_at = time.time() + hold.lease.ttl_s
        self._arm(hold)
        return hold.lease

    def end(self, lease_id: str, reason: str) -> Lease:
        """End a held lease: give the model (or machine) back; 404 if not held."""
        hold = self._held.pop(lease_id, None)
        if hold is None:
            raise _not_found(lease_id)
        if hold.expiry is not None:
            hold.expiry.cancel()
        if hold.watcher is not None and hold.watcher is not asyncio.current_task():
            hold.watcher.cancel()
        if hold.engine_stream is not None:
            hold.engine_stream.close()
        if hold.slot is None:
            self._pool.machine.release()
        elif hold.slot.lease_id == lease_id:
            self._pool.admin.unhold(hold.slot)
        hold.lease.state, hold.lease.ended_reason = "ended", reason
        self._ended.append(hold.lease)
        log.info("lease %s ended: %s", lease_id, reason)
        return hold.lease

    def end_all(self) -> None:
        """At shutdown."""
        for lease_id in list(self._held):
            self.end(lease_id, "shutdown")

    async def _hold_engine(self, hold: _Hold) -> None:
        """Open the engine's exclusive-execution lease stream and wait for its `held` line."""
        assert hold.slot is not None
        body = msgspec.json.encode(LeaseRequest(hold.lease.holder, ENGINE_LEASE_WAIT_S))
        try:
            up = await open_upstream(hold.slot.engine.socket, "POST", LEASE_PATH, body)
        except (TimeoutError, OSError) as exc:
            raise APIError(503, f"The engine could not be leased: {exc or type(exc).__name__}", type="server_error",
                           code="lease_failed") from None
        try:
            first = await _first_line(up)
        except BaseException:  # our caller left: don't keep the engine's lease open
            up.close()
            raise
        if up.head is None or (up.lost and not first):
            up.close()
            raise APIError(503, "The engine died while being leased.", type="server_error", code="lease_failed")
        held = _held_line(first) if up.head.status == 200 else None
        if held is None:
            detail = first[:200].decode(errors="replace") or "no held line"
            up.close()
            raise APIError(503, f"The engine refused the lease: {detail}", type="server_error", code="lease_failed")
        hold.slot.engine_lease_token = held.token or ""
        hold.engine_stream = up
        hold.watcher = self._spawn(self._watch_engine(hold))

    async def _watch_engine(self, hold: _Hold) -> None:
        """The engine's lease stream ends only when the engine goes: then so does the lease."""
        up = hold.engine_stream
        assert up is not None
        while not (up.ended or up.lost):  # heartbeats, read and dropped
            up.take_body()
            await up.changed()
        if hold.lease.id in self._held:
            self.end(hold.lease.id, "engine_crashed")

    def _on_engine_lost(self, lease_id: str) -> None:
        if lease_id in self._held:
            self.end(lease_id, "engine_crashed")

    def _arm(self, hold: _Hold) -> None:
        if hold.expiry is not None:
            hold.expiry.cancel()
        delay = max(0.0, hold.lease.expires_at - time.time())
        lease_id = hold.lease.id
        hold.expiry = asyncio.get_running_loop().call_later(delay, lambda: self._expire(lease_id))

    def _expire(self, lease_id: str) -> None:
        if lease_id in self._held:
            self.end(lease_id, "expired")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


async def _first_line(up: Upstream) -> bytes:
    """The first line of an answer (for an error answer, its whole body, up to 64 KB)."""
    buf = b""
    while True:
        buf += b"".join(up.take_body())
        if (up.head is not None and up.head.status == 200 and b"\n" in buf) or len(buf) > 65536:
            return buf.split(b"\n", 1)[0]
        if up.ended or up.lost:
            return buf
        await up.changed()


def _held_line(line: bytes) -> LeaseLine | None:
    """The engine's first lease line, if it says the lease is held."""
    try:
        return _lease_line.decode(line)
    except msgspec.DecodeError:  # a ValidationError too: not `held`
        return None


def _not_found(lease_id: str) -> APIError:
    return APIError(404, f"No lease {lease_id!r} is held (it may have ended: see GET /admin/leases).",
                    type="invalid_request_error", code="lease_not_found")
