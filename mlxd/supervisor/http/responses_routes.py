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
from mlxd.protocol.supervisor_api import CompactedResponse, InputItemList, ResponseDeleted
from mlxd.supervisor.http import responses_socket
from mlxd.supervisor.http.answers import json_answer
from mlxd.supervisor.http.image_fetch import check_takes_images
from mlxd.supervisor.http.keys import CONFIG, IMAGES
from mlxd.supervisor.http.loopback import Loopback, error_of
from mlxd.supervisor.http.relaying import relay, resolve_target
from mlxd.supervisor.http.responses_generations import LIVE, go_on, recorded
from mlxd.supervisor.relay.responses_dialect import Keep, Responses
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
    raw = await request.read()
    req: responses.ResponsesRequest = decode_json(_decoder, raw)
    items = responses.input_items(req)
    store = request.app[STORE]
    history = await chain_items(request, req.previous_response_id)
    chat = responses.to_chat(req, history, items, stream=req.stream)
    target = resolve_target(request, req.model, req.adapter)
    entry = target.entry
    check_takes_images(entry, responses.first_image(items))
    await request.app[IMAGES].inline(chat)
    shell = responses.Shell(req, req.model or entry.id)
    if shell.dropped:
        log.info("responses: tools of type %s cannot run here; the model does not see them",
                 ", ".join(sorted(set(shell.dropped))))

    body = msgspec.json.encode(chat)
    dialect = Responses(shell, keeper(store, shell, items)) if req.store else Responses(shell)
    if not req.store:
        return await relay(request, target, body, dialect, stream=req.stream, started=started)
    return await recorded(request, store, shell, raw, body,
                          relay(request, target, body, dialect, stream=req.stream, started=started))


def keeper(store: AsyncStore, shell: responses.Shell, items: list[dict[str, Any]]) -> Keep:
    """The dialect's `keep`: the finished response into the store."""

    async def keep(response: dict[str, Any]) -> None:
        try:
            await store.run(store.store.put, shell.id, shell.req.previous_response_id, shell.model, items,
                            response["output"], response)
        except sqlite3.Error as exc:  # the answer still goes out; it cannot be chained on
            log.error("responses: storing %s failed: %s", shell.id, exc)

    return keep




COMPACT_ASK = ("Write a summary of the conversation above that lets it go on without it: what was asked, what "
               "was decided and done (files, commands, results, tool calls and what they returned), what is "
               "still open, and any names, numbers or code that will be needed. Write only the summary.")
COMPACT_MAX_TOKENS = 2048


async def compact(request: web.Request) -> web.Response:
    """POST /v1/responses/compact: the conversation so far (`previous_response_id`'s chain, then
    `input`) summarized by the model into one compaction item, with the last user message kept
    as it was. The returned `output` is the new context: send it as the next turn's input."""
    req: responses.ResponsesRequest = decode_json(_decoder, await request.read())
    items = responses.input_items(req)
    history = await chain_items(request, req.previous_response_id)
    chat = responses.to_chat(req, history, items)
    chat["messages"].append({"role": "user", "content": COMPACT_ASK})
    chat.update({"max_tokens": COMPACT_MAX_TOKENS, "temperature": 0, "stream": False})
    chat.pop("tools", None)
    chat.pop("tool_choice", None)
    loopback = Loopback(request)
    try:
        async with loopback.post("/v1/chat/completions", chat) as resp:
            if resp.status != 200:
                err = await error_of(resp)
                raise APIError(resp.status, err["message"], type=err["type"], param=err["param"], code=err["code"])
            answer = await resp.json()
    finally:
        await loopback.close()
    summary = (answer["choices"][0]["message"].get("content") or "").strip()
    users = [i for i in [*history, *items] if i["type"] == "message" and i["role"] == "user"]
    output = [responses.compaction_item(summary), *users[-1:]]
    usage = answer.get("usage") or {}
    return json_answer(CompactedResponse(
        responses.new_id("resp"), int(time.time()), answer.get("model") or req.model or "", output,
        {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
         "total_tokens": usage.get("total_tokens", 0)}))


async def chain_items(request: web.Request, previous: str | None) -> list[dict[str, Any]]:
    """The input and output items of `previous`'s chain, oldest first (a 404 for a broken chain)."""
    if previous is None:
        return []
    store = request.app[STORE]
    try:
        chain: list[Stored] = await store.run(store.store.chain, previous)
    except ChainBroken as gone:
        raise APIError(404, f"Previous response with id '{gone.missing}' not found.",
                       param="previous_response_id", code="previous_response_not_found") from None
    return [item for turn in chain for item in (*turn.input, *turn.output)]


async def retrieve(request: web.Request) -> web.StreamResponse:
    """GET /v1/responses/{id} (`?stream=true`: the stored response as the events of a stream)."""
    response_id = request.match_info["response_id"]
    store = request.app[STORE]
    stored = await store.run(store.store.get, response_id)
    if stored is None:
        gen = await store.run(store.store.generation, response_id)
        if gen is None:
            raise not_found(response_id)
        return await go_on(request, store, gen, keeper)  # being made, or cut off by a restart
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
    app[LIVE] = set()
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses", responses_socket.socket)  # the WebSocket mode
    app.router.add_post("/v1/responses/compact", compact)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_get("/v1/responses/{response_id}/input_items", input_items)
    app.cleanup_ctx.append(store_ctx)
