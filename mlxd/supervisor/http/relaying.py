"""The routes' way into the relay: a request's model resolved and its body relayed, with the
app's pool, stream keep-alive and time-to-first-token metric."""

from __future__ import annotations

from aiohttp import web

from mlxd.supervisor.http.keys import AUTH, CONFIG, METRICS, POOL, REGISTRY
from mlxd.supervisor.registry import ModelEntry
from mlxd.supervisor.relay.dialect import Dialect
from mlxd.supervisor.relay.serve import serve


def resolve(request: web.Request, model: str | None) -> ModelEntry:
    """The model a request names (or the only one there is); 404 in the caller's API if none."""
    return request.app[REGISTRY].resolve(model, request.app[POOL].loaded_ids())


async def relay(
    request: web.Request, entry: ModelEntry, body: bytes, dialect: Dialect, *, stream: bool, started: float,
    priority: int | None = None,
) -> web.StreamResponse:
    """Relay `body` to `entry`'s engine, answering in `dialect`; `started` is when the request came,
    `priority` the body's own (None: its key's default, else 0)."""
    ttft = request.app[METRICS].get().ttft.labels(entry.id)
    return await serve(request, request.app[POOL], entry, body, dialect, stream=stream,
                       keepalive_s=request.app[CONFIG].server.stream_keepalive_s,
                       priority=priority, key_priority=request.app[AUTH].default_priority(request.headers),
                       on_first_chunk=lambda at: ttft.observe(at - started))
