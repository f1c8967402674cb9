"""The routes' way into the relay: a request's model (and adapters) resolved and its body
relayed, with the app's pool, stream keep-alive and time-to-first-token metric."""

from __future__ import annotations

from typing import NamedTuple

from aiohttp import web

from mlxd.protocol.errors import APIError
from mlxd.supervisor.adapters import AdapterEntry
from mlxd.supervisor.http.keys import ADAPTERS, AUTH, CONFIG, METRICS, POOL, REGISTRY
from mlxd.supervisor.registry import ModelEntry
from mlxd.supervisor.relay.dialect import Dialect
from mlxd.supervisor.relay.serve import serve


class Target(NamedTuple):
    """What a request runs on: a model, under a stack of adapters (none: the base model)."""

    entry: ModelEntry
    adapters: tuple[AdapterEntry, ...] = ()


def resolve(request: web.Request, model: str | None) -> ModelEntry:
    """The model a request names (or the only one there is); 404 in the caller's API if none."""
    return request.app[REGISTRY].resolve(model, request.app[POOL].loaded_ids())


def resolve_target(request: web.Request, model: str | None, adapter: str | None) -> Target:
    """The model and adapters a request names: `adapter` ("id", "a+b", "none"), else the
    `base:adapter` form of its model id, else the model's configured default adapter. A 404 for
    an unknown model; a 400 for an unknown adapter or one made for another model."""
    try:
        entry = resolve(request, model)
        suffix = None
    except APIError as err:
        base, _, suffix = (model or "").rpartition(":")
        if err.status != 404 or not base or not suffix:
            raise
        try:
            entry = resolve(request, base)
        except APIError:
            raise err from None
    spec = adapter if adapter is not None else suffix if suffix is not None else entry.adapter
    if not spec:
        return Target(entry)
    return Target(entry, request.app[ADAPTERS].stack(spec, entry, request.app[REGISTRY]))


async def relay(
    request: web.Request, target: ModelEntry | Target, body: bytes, dialect: Dialect, *, stream: bool, started: float,
    priority: int | None = None,
) -> web.StreamResponse:
    """Relay `body` to the target's engine, answering in `dialect`; `started` is when the request
    came, `priority` the body's own (None: its key's default, else 0)."""
    target = target if isinstance(target, Target) else Target(target)
    ttft = request.app[METRICS].get().ttft.labels(target.entry.id)
    return await serve(request, request.app[POOL], target.entry, body, dialect, stream=stream,
                       keepalive_s=request.app[CONFIG].server.stream_keepalive_s,
                       priority=priority, key_priority=request.app[AUTH].default_priority(request.headers),
                       on_first_chunk=lambda at: ttft.observe(at - started), adapters=target.adapters)
