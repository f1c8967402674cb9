"""OpenAI's Responses API on the supervisor: translated to the engine's chat API
(mlxd/protocol/responses.py) and relayed like any inference request, in the Responses
dialect (relay/responses_dialect.py), with the durable
response store (response_store.py) behind `previous_response_id` and the GET / DELETE /
input_items routes. A response is stored (unless `store: false`) before its last event or
its body goes out, so a client that saw it complete can chain on it, even across a restart.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

from mlxd.protocol import responses
from mlxd.protocol.errors import APIError
from mlxd.protocol.json_body import decode_json
from mlxd.protocol.responses_stream import replay
from mlxd.protocol.supervisor_api import InputItemList, ResponseDeleted
from mlxd.supervisor.http.answers import json_answer
from mlxd.supervisor.http.image_fetch import check_takes_images
from mlxd.supervisor.http.keys import CONFIG, IMAGES
from mlxd.supervisor.http.relaying import relay, resolve_target
from mlxd.supervisor.relay.responses_dialect import Responses
from mlxd.supervisor.relay.sse import SSE_HEADERS
from mlxd.supervisor.response_store import AsyncStore, ChainBroken, ResponseStore, Stored

log = logging.getLogger("mlxd.supervisor")
STORE = web.AppKey("response_store", AsyncStore)
_decoder = msgspec.json.Decoder(responses.ResponsesRequest)


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", code="response_not_found")


async def create(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    started = time.perf_counter()
    req: responses.ResponsesRequest = decode_json(_decoder, await request.read())
    items = responses.input_items(req)
    store = request.app[STORE]
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        try:
            chain: list[Stored] = await store.run(store.store.chain, req.previous_response_id)
        except ChainBroken as gone:
            raise APIError(404, f"Previous response with id '{gone.missing}' not found.",
                           param="previous_response_id", code="previous_response_not_found") from None
        history = [item for turn in chain for item in (*turn.input, *turn.output)]
    chat = responses.to_chat(req, history, items, stream=req.stream)
    target = resolve_target(request, req.model, req.adapter)
    entry = target.entry
    check_takes_images(entry, responses.first_image(items))
    await request.app[IMAGES].inline(chat)
    shell = responses.Shell(req, req.model or entry.id)
    if shell.dropped:
        log.info("responses: tools of type %s cannot run here; the model does not see them",
                 ", ".join(sorted(set(shell.dropped))))

    async def keep(response: dict[str, Any]) -> None:
        if not req.store:
            return
        try:
            await store.run(store.store.put, shell.id, req.previous_response_id, shell.model, items,
                            response["output"], response)
        except sqlite3.Error as exc:  # the answer still goes out; it cannot be chained on
            log.error("responses: storing %s failed: %s", shell.id, exc)

    dialect = Responses(shell, keep)
    return await relay(request, target, msgspec.json.encode(chat), dialect, stream=req.stream, started=started)


async def retrieve(request: web.Request) -> web.StreamResponse:
    """GET /v1/responses/{id} (`?stream=true`: the stored response as the events of a stream)."""
    response_id = request.match_info["response_id"]
    store = request.app[STORE]
    stored = await store.run(store.store.get, response_id)
    if stored is None:
        raise not_found(response_id)
    if request.query.get("stream", "").lower() == "true":
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(replay(stored.response))
        await resp.write_eof()
        return resp
    return web.Response(body=msgspec.json.encode(stored.response), content_type="application/json")


async def delete(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{id}."""
    response_id = request.match_info["response_id"]
    store = request.app[STORE]
    if not await store.run(store.store.delete, response_id):
        raise not_found(response_id)
    return json_answer(ResponseDeleted(response_id, "response", deleted=True))


async def input_items(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}/input_items: the response's own input items (`limit` 1-100,
    `order` asc or desc, `after` an item id)."""
    response_id = request.match_info["response_id"]
    try:
        limit = int(request.query.get("limit", "20"))
    except ValueError:
        raise APIError(400, "limit must be an integer from 1 to 100.", param="limit") from None
    order = request.query.get("order", "desc")
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be an integer from 1 to 100.", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, "order must be asc or desc.", param="order")
    store = request.app[STORE]
    stored = await store.run(store.store.get, response_id)
    if stored is None:
        raise not_found(response_id)
    items = list(stored.input) if order == "asc" else list(reversed(stored.input))
    if after := request.query.get("after"):
        ids = [i.get("id") for i in items]
        if after not in ids:
            raise APIError(400, f"No input item {after!r} in response {response_id}.", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return json_answer(InputItemList("list", page, first_id=page[0]["id"] if page else None,
                                     last_id=page[-1]["id"] if page else None, has_more=len(items) > limit))


async def store_ctx(app: web.Application) -> AsyncIterator[None]:
    """The store closes with the app."""
    yield
    app[STORE].close()


def setup_responses_routes(app: web.Application, store: ResponseStore | None) -> None:
    """The routes, on `store` (None: a store in memory, for an app made without a data dir)."""
    config = app[CONFIG].responses
    app[STORE] = AsyncStore(store if store is not None else ResponseStore(None, config.ttl_s, config.max_bytes))
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_get("/v1/responses/{response_id}/input_items", input_items)
    app.cleanup_ctx.append(store_ctx)
