"""Supervisor handlers: route inference by `model` to its engine; list models; health."""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from mlxd import __version__
from mlxd.protocol.errors import APIError
from mlxd.protocol.json_body import decode_json
from mlxd.protocol.process import LEASE_HEADER
from mlxd.supervisor.keys import METRICS, POOL, REGISTRY
from mlxd.supervisor.metrics import MODEL_KEY
from mlxd.supervisor.proxy import EngineBusy, forward

MAX_REQUEUES = 3


class ModelField(msgspec.Struct):
    """Only the routing field; the engine validates the rest of the body."""

    model: str | None = None


_model_decoder = msgspec.json.Decoder(ModelField)


def requested_model(body: bytes) -> str | None:
    """The body's `model` field; 400 when the body is not a JSON object or `model` no string."""
    model: str | None = decode_json(_model_decoder, body).model
    return model


async def inference(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions and /v1/completions: start the model's engine if needed, relay."""
    started = time.perf_counter()
    body = await request.read()
    pool = request.app[POOL]
    entry = request.app[REGISTRY].resolve(requested_model(body), pool.loaded_ids())
    request[MODEL_KEY] = entry.id
    ttft = request.app[METRICS].get().ttft.labels(entry.id)
    lease_id = request.headers.get(LEASE_HEADER)
    for _ in range(MAX_REQUEUES):
        async with pool.use(entry, lease_id) as slot:
            headers = {LEASE_HEADER: slot.engine_lease_token} if lease_id and slot.engine_lease_token else {}
            try:
                return await forward(
                    request, slot.engine.socket, slot.engine.connections, body, headers,
                    on_first_chunk=lambda: ttft.observe(time.perf_counter() - started),
                )
            except EngineBusy:
                continue  # raced a drain or lease at the engine: wait in the queue again
    raise APIError(503, f"Model {entry.id} stayed busy; try again.", type="server_error", code="engine_busy",
                   headers={"Retry-After": "1"})


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: every model that exists, in OpenAI's shape, with whether it is loaded."""
    registry, pool = request.app[REGISTRY], request.app[POOL]
    registry.refresh()
    states = {e.model_id: e.state.value for e in pool.engines()}
    data = [
        {
            "id": m.id, "object": "model", "created": int(time.time()), "owned_by": "mlxd",
            "loaded": states.get(m.id) == "ready", "state": states.get(m.id, "stopped"),
            "source": m.source, "size_bytes": m.size_bytes,
        }
        for m in registry.entries()
    ]
    return web.json_response({"object": "list", "data": data})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text format."""
    return web.Response(body=request.app[METRICS].get().render(), content_type="text/plain", charset="utf-8")


async def health(request: web.Request) -> web.Response:
    """GET /health (no auth): the supervisor is up."""
    engines = {e.model_id: e.state.value for e in request.app[POOL].engines()}
    return web.json_response({"status": "ok", "version": __version__, "engines": engines})

