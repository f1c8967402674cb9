"""Anthropic's Messages API on the supervisor: translated to the engine's OpenAI chat API
(mlxd/protocol/anthropic.py) and relayed like any inference request, queueing, leases,
crash handling and all, in Anthropic's dialect (relay/anthropic_dialect.py)."""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from mlxd.protocol import anthropic
from mlxd.protocol.json_body import decode_json
from mlxd.supervisor.http.image_fetch import check_takes_images
from mlxd.supervisor.http.keys import IMAGES
from mlxd.supervisor.http.relaying import relay, resolve_target
from mlxd.supervisor.relay.anthropic_dialect import AnthropicCountTokens, AnthropicMessages

_messages = msgspec.json.Decoder(anthropic.MessagesRequest)
_count = msgspec.json.Decoder(anthropic.CountTokensRequest)


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages (`?beta=true` and `anthropic-beta` headers are accepted and ignored)."""
    started = time.perf_counter()
    req: anthropic.MessagesRequest = decode_json(_messages, await request.read())
    chat = anthropic.to_chat(req, stream=req.stream)
    target = resolve_target(request, req.model, req.adapter)
    check_takes_images(target.entry, anthropic.first_image(req))
    await request.app[IMAGES].inline(chat)
    dialect = AnthropicMessages(req.model or target.entry.id)
    return await relay(request, target, msgspec.json.encode(chat), dialect, stream=req.stream, started=started)


async def count_tokens(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages/count_tokens: the prompt the request becomes, counted by the model's
    engine (its chat template, tools included), without generating."""
    started = time.perf_counter()
    req: anthropic.CountTokensRequest = decode_json(_count, await request.read())
    chat = anthropic.to_chat(req)
    entry = resolve_target(request, req.model, None).entry  # the prompt is the same under any adapter
    check_takes_images(entry, anthropic.first_image(req))
    await request.app[IMAGES].inline(chat)
    dialect = AnthropicCountTokens(req.model or entry.id)
    return await relay(request, entry, msgspec.json.encode(chat), dialect, stream=False, started=started)


def setup_anthropic_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
