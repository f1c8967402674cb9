"""OpenAI's chat and text completions and embeddings, relayed by `model` to its engine as they
are; the model list."""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from mlxd.protocol.json_body import decode_json
from mlxd.protocol.openai import AdapterSpec, Priority
from mlxd.supervisor.http.answers import json_answer
from mlxd.supervisor.http.keys import IMAGES, POOL, REGISTRY
from mlxd.supervisor.http.relaying import relay, resolve_target
from mlxd.supervisor.registry import capabilities_of, sampling_of
from mlxd.supervisor.relay.dialect import ModelRow
from mlxd.supervisor.relay.dialects import dialect_of, models_dialect


class RoutingFields(msgspec.Struct):
    """Only the fields the supervisor routes by; the engine validates the rest of the body."""

    model: str | None = None
    stream: bool | None = None
    priority: Priority | None = None  # orders the pool's queue too (the engine checks the rest)
    adapter: AdapterSpec | None = None  # mlxd's: the LoRA adapters it runs under


_routing_decoder = msgspec.json.Decoder(RoutingFields)


def routing_fields(body: bytes) -> RoutingFields:
    """The body's `model` and `stream`; 400 when the body is not a JSON object or they have the wrong type."""
    fields: RoutingFields = decode_json(_routing_decoder, body)
    return fields


async def inference(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions and /v1/completions: start the model's engine if needed, relay."""
    started = time.perf_counter()
    body = await request.read()
    fields = routing_fields(body)
    target = resolve_target(request, fields.model, fields.adapter)
    body = await request.app[IMAGES].inline_body(body)  # images by URL: fetched here (http/image_fetch.py)
    return await relay(request, target, body, dialect_of(request), stream=bool(fields.stream), started=started,
                       priority=fields.priority)


async def embeddings(request: web.Request) -> web.StreamResponse:
    """POST /v1/embeddings: relayed by `model` to its engine (an embedding model's; a generating
    model's engine answers 400)."""
    started = time.perf_counter()
    body = await request.read()
    fields = routing_fields(body)
    target = resolve_target(request, fields.model, None)
    return await relay(request, target, body, dialect_of(request), stream=False, started=started,
                       priority=fields.priority)


async def curve_call(request: web.Request) -> web.StreamResponse:
    """POST /signal and POST /generate, the curve designer's calls: relayed by `model` (none:
    the default model) to its engine (engine/http/curve_routes.py)."""
    started = time.perf_counter()
    body = await request.read()
    fields = routing_fields(body)
    target = resolve_target(request, fields.model, None)
    return await relay(request, target, body, dialect_of(request), stream=False, started=started)


async def curves_page(request: web.Request) -> web.Response:
    """GET /curves: the curve designer, a view of the web app (the reference's address)."""
    raise web.HTTPFound("/#curves")


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: every model that exists, with whether it is loaded, in OpenAI's shape
    (Anthropic's for a caller that sends `anthropic-version`)."""
    registry, pool = request.app[REGISTRY], request.app[POOL]
    registry.refresh()
    engines = {e.model_id: e for e in pool.engines()}
    rows = [ModelRow(m, engines[m.id].state, engines[m.id].load_progress(), sampling_of(m), capabilities_of(m))
            if m.id in engines else ModelRow(m, sampling=sampling_of(m), capabilities=capabilities_of(m))
            for m in registry.entries()]
    return json_answer(models_dialect(request).model_list(rows, int(time.time())))


def setup_openai_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", inference)
    app.router.add_post("/v1/completions", inference)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/signal", curve_call)
    app.router.add_post("/generate", curve_call)
    app.router.add_get("/curves", curves_page)
    app.router.add_get("/v1/models", list_models)
