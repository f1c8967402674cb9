"""Supervisor handlers: route inference by `model` to its engine; list models; health."""

from __future__ import annotations

import asyncio
import time

import msgspec
from aiohttp import web

from mlxd import __version__
from mlxd.protocol import anthropic
from mlxd.protocol.errors import APIError
from mlxd.protocol.json_body import decode_json
from mlxd.protocol.process import LEASE_HEADER
from mlxd.supervisor.access import FIRST_CHUNK_KEY, MODEL_KEY
from mlxd.supervisor.dialects import OPENAI, Translation, engine_error
from mlxd.supervisor.keys import CONFIG, METRICS, POOL, REGISTRY
from mlxd.supervisor.proxy import EngineBusy, EngineUnreachable, crashed_error, forward
from mlxd.supervisor.registry import ModelEntry
from mlxd.supervisor.waiting import WaitingStream

MAX_REQUEUES = 5
UNREACHABLE_PAUSE_S = 0.05


class RoutingFields(msgspec.Struct):
    """Only the fields the supervisor routes by; the engine validates the rest of the body."""

    model: str | None = None
    stream: bool | None = None


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
    entry = request.app[REGISTRY].resolve(fields.model, request.app[POOL].loaded_ids())
    return await serve(request, entry, body, bool(fields.stream), started)


async def serve(
    request: web.Request, entry: ModelEntry, body: bytes, stream: bool, started: float,
    translation: Translation | None = None,
) -> web.StreamResponse:
    """Queue for `entry`'s engine and relay `body` to it (through `translation`, for a caller
    in another API). A stream that waits long for its engine gets SSE comments meanwhile
    (waiting.py); its errors then come as an SSE error event in the caller's API."""
    request[MODEL_KEY] = entry.id
    dialect = translation.dialect if translation is not None else OPENAI
    engine = request.app[POOL].slot_for(entry).engine
    keepalive_s = request.app[CONFIG].server.stream_keepalive_s
    waiting = WaitingStream(request, keepalive_s, dialect, engine.load_progress) if stream else None
    try:
        return await _route(request, entry, body, started, waiting, translation)
    except APIError as err:
        if waiting is None or waiting.response is None:
            raise
        return await waiting.fail(err)
    except ConnectionResetError:
        if waiting is None or waiting.response is None:
            raise
        return waiting.response  # the caller left while it waited: nothing more to say


async def _route(
    request: web.Request, entry: ModelEntry, body: bytes, started: float, waiting: WaitingStream | None,
    translation: Translation | None,
) -> web.StreamResponse:
    pool = request.app[POOL]
    ttft = request.app[METRICS].get().ttft.labels(entry.id)

    def on_first_chunk() -> None:
        request[FIRST_CHUNK_KEY] = time.perf_counter()
        ttft.observe(request[FIRST_CHUNK_KEY] - started)

    lease_id = request.headers.get(LEASE_HEADER)
    pause_s, num_resent = 0.0, 0
    for _ in range(MAX_REQUEUES):
        await asyncio.sleep(pause_s)  # after an unreachable engine: its owner sees the exit meanwhile
        acquire = pool.acquire(entry, lease_id)
        slot = await (waiting.wait(acquire, pool.release) if waiting is not None else acquire)
        try:
            headers = {LEASE_HEADER: slot.engine_lease_token} if lease_id and slot.engine_lease_token else {}
            prepared = waiting.response if waiting is not None else None
            resp = await forward(
                request, slot.engine.socket, slot.engine.connections, body, headers,
                on_first_chunk=on_first_chunk, prepared=prepared,
                translation=translation,
            )
        except EngineUnreachable as dead:
            if dead.was_sent and num_resent:
                raise crashed_error() from None
            num_resent += dead.was_sent
            pause_s = UNREACHABLE_PAUSE_S
            continue  # it died before it took the request: wait in the queue for its restart
        except EngineBusy:
            continue  # raced a drain or lease at the engine: wait in the queue again
        finally:
            pool.release(slot)
        if waiting is not None and waiting.response is not None and isinstance(resp, web.Response):
            data = resp.body if isinstance(resp.body, bytes) else b"{}"
            return await waiting.fail(engine_error(resp.status, data))  # an error, after the SSE head went out
        return resp
    raise APIError(503, f"Model {entry.id} stayed busy or unreachable; try again.", type="server_error",
                   code="engine_busy", headers={"Retry-After": "1"})


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: every model that exists, in OpenAI's shape, with whether it is loaded
    (in Anthropic's shape for a caller that sends `anthropic-version`)."""
    registry, pool = request.app[REGISTRY], request.app[POOL]
    registry.refresh()
    if "anthropic-version" in request.headers:
        cards = [anthropic.model_card(m.id) for m in registry.entries()]
        return web.json_response({"data": cards, "has_more": False, "first_id": cards[0]["id"] if cards else None,
                                  "last_id": cards[-1]["id"] if cards else None})
    engines = {e.model_id: e for e in pool.engines()}
    states = {model_id: e.state.value for model_id, e in engines.items()}
    data = [
        {
            "id": m.id, "object": "model", "created": int(time.time()), "owned_by": "mlxd",
            "loaded": states.get(m.id) == "ready", "state": states.get(m.id, "stopped"),
            "source": m.source, "size_bytes": m.size_bytes,
            "load": msgspec.to_builtins(engines[m.id].load_progress()) if m.id in engines else None,
        }
        for m in registry.entries()
    ]
    return web.json_response({"object": "list", "data": data})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text format (engines' prompt-cache figures fetched first)."""
    await asyncio.gather(*(engine.fetch_prompt_cache() for engine in request.app[POOL].engines()))
    return web.Response(body=request.app[METRICS].get().render(), content_type="text/plain", charset="utf-8")


async def health(request: web.Request) -> web.Response:
    """GET /health (no auth): the supervisor is up."""
    engines = {e.model_id: e.state.value for e in request.app[POOL].engines()}
    return web.json_response({"status": "ok", "version": __version__, "engines": engines})

