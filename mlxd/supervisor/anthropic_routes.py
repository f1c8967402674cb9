"""Anthropic's Messages API on the supervisor: translated to the engine's OpenAI chat API
(mlxd/protocol/anthropic.py) and relayed like any inference request, queueing, leases,
crash handling and all. Errors are in Anthropic's shape (dialects.py)."""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from mlxd.protocol import anthropic
from mlxd.protocol.json_body import decode_json
from mlxd.supervisor.dialects import ANTHROPIC, Translation
from mlxd.supervisor.keys import POOL, REGISTRY
from mlxd.supervisor.registry import ModelEntry
from mlxd.supervisor.routes import serve

_messages = msgspec.json.Decoder(anthropic.MessagesRequest)
# the engine's chat field names, as this API calls them (in error messages' `param`)
PARAMS = (("response_format.json_schema.schema", "output_config.format.schema"),
          ("response_format", "output_config.format"), ("stop", "stop_sequences"))
_count = msgspec.json.Decoder(anthropic.CountTokensRequest)


def _entry(request: web.Request, model: str | None) -> ModelEntry:
    return request.app[REGISTRY].resolve(model, request.app[POOL].loaded_ids())


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages (`?beta=true` and `anthropic-beta` headers are accepted and ignored)."""
    started = time.perf_counter()
    req: anthropic.MessagesRequest = decode_json(_messages, await request.read())
    chat = anthropic.to_chat(req, stream=req.stream)
    entry = _entry(request, req.model)
    model = req.model or entry.id

    async def whole(status: int, data: bytes) -> tuple[int, bytes]:
        return status, msgspec.json.encode(anthropic.from_chat(msgspec.json.decode(data), model))

    stream = (lambda: anthropic.MessageStream(model)) if req.stream else None
    translation = Translation("/v1/chat/completions", ANTHROPIC, stream, whole, params=PARAMS)
    return await serve(request, entry, msgspec.json.encode(chat), req.stream, started, translation)


async def count_tokens(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages/count_tokens: the prompt the request becomes, counted by the model's
    engine (its chat template, tools included), without generating."""
    started = time.perf_counter()
    req: anthropic.CountTokensRequest = decode_json(_count, await request.read())
    chat = anthropic.to_chat(req)
    entry = _entry(request, req.model)

    async def whole(status: int, data: bytes) -> tuple[int, bytes]:
        rendered = msgspec.json.decode(data)
        return status, msgspec.json.encode({"input_tokens": int(rendered["prompt_tokens"])})

    translation = Translation("/v1/chat/render", ANTHROPIC, None, whole, params=PARAMS)
    return await serve(request, entry, msgspec.json.encode(chat), False, started, translation)


def setup_anthropic_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
