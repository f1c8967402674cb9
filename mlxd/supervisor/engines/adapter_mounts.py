"""Which adapters each engine has loaded, and loading them there before a request needs them.

A request under adapters reaches its engine only once each of them is mounted there (the
engine's POST /admin/adapters, which reads the weights on its GPU thread between steps). What
an engine has mounted is known per engine process: one that restarted (a crash, a swap) has
none, and they are mounted again as requests ask for them. Adapters loaded on purpose
(`POST /v1/adapters`) are mounted again as soon as the next request reaches the new process,
and count in the model's memory booking for as long as they are kept. Adapters a request
loaded count in it too (their size as the engine reports it), for as long as that engine
process has them: an engine that restarts gives their booking back.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec

from mlxd.protocol.errors import APIError
from mlxd.protocol.process import ADAPTERS_PATH, AdapterInfo, AdapterMount
from mlxd.supervisor.adapters import AdapterEntry
from mlxd.supervisor.engines.engine import Engine
from mlxd.supervisor.engines.upstream import EngineUnreachable, UpstreamError, call

log = logging.getLogger("mlxd.supervisor")
MOUNT_TIMEOUT_S = 120.0  # reading an adapter is quick, but waits for the GPU thread's current step


@dataclass
class _Mounted:
    pid: int | None  # the engine process these are mounted in
    adapters: dict[str, tuple[AdapterEntry, AdapterInfo]] = field(default_factory=dict)
    booked: dict[str, int] = field(default_factory=dict)  # bytes booked for those mounted on first use


class AdapterMounts:
    """Per model: what its engine has mounted, and what is kept loaded (loop thread only)."""

    def __init__(self) -> None:
        self._mounted: dict[str, _Mounted] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.kept: dict[str, dict[str, AdapterEntry]] = {}  # model id -> adapters loaded on purpose

    def mounted(self, engine: Engine) -> dict[str, tuple[AdapterEntry, AdapterInfo]]:
        """What `engine`'s current process has mounted (nothing once it restarted)."""
        state = self._mounted.get(engine.model_id)
        return dict(state.adapters) if state is not None and state.pid == engine.pid else {}

    def keep(self, slot: Any, adapter: AdapterEntry) -> None:
        """Keep `adapter` loaded on the slot's model (mounted again after a restart), its
        weights booked in the slot's memory."""
        kept = self.kept.setdefault(slot.entry.id, {})
        old = kept.get(adapter.id)
        kept[adapter.id] = adapter
        slot.memory_bytes += adapter.size_bytes - (old.size_bytes if old is not None else 0)
        self._unbook(slot, adapter.id)  # booked as kept from now on, not twice

    def forget(self, slot: Any, adapter_id: str) -> bool:
        """Keep it no more (its booking goes); whether it was kept."""
        old = self.kept.get(slot.entry.id, {}).pop(adapter_id, None)
        if old is not None:
            slot.memory_bytes -= old.size_bytes
        return old is not None

    async def ensure(self, slot: Any, stack: tuple[AdapterEntry, ...]) -> None:
        """Mount on the slot's engine each adapter of `stack` (and those kept for its model) it
        lacks. A 400 when the engine cannot load one; EngineUnreachable if it is gone."""
        engine: Engine = slot.engine
        wanted = {a.id: a for a in (*self.kept.get(engine.model_id, {}).values(), *stack)}
        if all(self._has(engine, a) for a in wanted.values()):
            return
        async with self._locks.setdefault(engine.model_id, asyncio.Lock()):
            for adapter in wanted.values():
                if not self._has(engine, adapter):
                    await self._mount(slot, adapter)

    def _unbook(self, slot: Any, adapter_id: str) -> None:
        """Give back what a mount on first use booked for `adapter_id` on the slot's model."""
        state = self._mounted.get(slot.entry.id)
        if state is not None and (size := state.booked.pop(adapter_id, None)) is not None:
            slot.memory_bytes -= size

    def release(self, slot: Any) -> None:
        """The slot's engine starts a new process, which has none mounted: their booking goes."""
        state = self._mounted.pop(slot.entry.id, None)
        if state is not None:
            slot.memory_bytes -= sum(state.booked.values())

    def _has(self, engine: Engine, adapter: AdapterEntry) -> bool:
        state = self._mounted.get(engine.model_id)
        if state is None or state.pid != engine.pid:
            return False
        found = state.adapters.get(adapter.id)
        return found is not None and found[0].path == adapter.path

    async def _mount(self, slot: Any, adapter: AdapterEntry) -> None:
        engine: Engine = slot.engine
        body = msgspec.json.encode(AdapterMount(adapter.id, str(adapter.path)))
        try:
            status, data = await call(engine.socket, "POST", ADAPTERS_PATH, body, timeout_s=MOUNT_TIMEOUT_S)
        except (OSError, UpstreamError, TimeoutError):
            raise EngineUnreachable(was_sent=False) from None
        if status != 200:
            raise _engine_error(status, data)
        info = msgspec.json.decode(data, type=AdapterInfo)
        state = self._mounted.get(engine.model_id)
        if state is None or state.pid != engine.pid:
            if state is not None:  # a process that is gone, with its adapters: their booking goes
                slot.memory_bytes -= sum(state.booked.values())
            state = self._mounted[engine.model_id] = _Mounted(engine.pid)
        state.adapters[adapter.id] = (adapter, info)
        if adapter.id not in self.kept.get(engine.model_id, {}):
            slot.memory_bytes += info.size_bytes - state.booked.get(adapter.id, 0)
            state.booked[adapter.id] = info.size_bytes
        log.info("%s: adapter %s loaded (%s, rank %d, %.1f MB)", engine.model_id, adapter.id, info.kind, info.rank,
                 info.size_bytes / 1e6)

    async def unmount(self, slot: Any, adapter_id: str) -> bool:
        """Unload `adapter_id` from the slot's engine (requests running under it finish under
        it); whether it was mounted there."""
        engine: Engine = slot.engine
        state = self._mounted.get(engine.model_id)
        if state is None or state.pid != engine.pid or adapter_id not in state.adapters:
            return False
        async with self._locks.setdefault(engine.model_id, asyncio.Lock()):
            state.adapters.pop(adapter_id, None)
            self._unbook(slot, adapter_id)
            try:
                status, _ = await call(engine.socket, "DELETE", f"{ADAPTERS_PATH}/{adapter_id}", timeout_s=MOUNT_TIMEOUT_S)
            except (OSError, UpstreamError, TimeoutError):
                return True  # the process is gone, and the adapter with it
        return status in (200, 404)


def _engine_error(status: int, data: bytes) -> APIError:
    try:
        error = msgspec.json.decode(data)["error"]
        return APIError(status, str(error["message"]), param="adapter", code=error.get("code"),
                        type="invalid_request_error" if status < 500 else "server_error")
    except (msgspec.DecodeError, KeyError, TypeError):
        return APIError(502, f"The engine could not load the adapter (status {status}).", type="server_error")
