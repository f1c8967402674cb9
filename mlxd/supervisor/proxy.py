"""Relay a request to an engine over its Unix socket, streaming the answer back unparsed."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import aiohttp
import msgspec
from aiohttp import web

from mlxd.protocol.errors import APIError

CRASHED = "The model's engine stopped unexpectedly; it is being restarted. Try again."
_UPSTREAM_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError)


class EngineBusy(Exception):
    """The engine turned the request away before starting it (draining or leased): queue it again."""


def crashed_error() -> APIError:
    """What a request in flight on a dying engine gets."""
    return APIError(502, CRASHED, type="server_error", code="engine_crashed", headers={"Retry-After": "1"})


async def forward(
    request: web.Request, session: aiohttp.ClientSession, body: bytes, headers: Mapping[str, str],
    on_first_chunk: Callable[[], None] = lambda: None,
) -> web.StreamResponse:
    """POST `body` to the same path on the engine; relay its answer chunk by chunk."""
    try:
        upstream = await session.post(
            "http://engine" + request.path_qs, data=body, headers={"Content-Type": "application/json", **headers}
        )
    except _UPSTREAM_ERRORS:
        raise crashed_error() from None
    async with upstream:
        if upstream.content_type != "text/event-stream":
            return await relay_whole(upstream)
        return await relay_stream(request, upstream, on_first_chunk)


async def relay_whole(upstream: aiohttp.ClientResponse) -> web.Response:
    """A non-streaming answer, passed through as-is."""
    try:
        data = await upstream.read()
    except _UPSTREAM_ERRORS:
        raise crashed_error() from None
    if upstream.status == 503 and is_busy(data):
        raise EngineBusy
    headers = {k: v for k, v in upstream.headers.items() if k.lower() == "retry-after"}
    return web.Response(status=upstream.status, body=data, content_type=upstream.content_type, headers=headers)


def is_busy(data: bytes) -> bool:
    """An engine's 503 `draining` or `leased`: nothing ran, so the request can wait and retry."""
    try:
        code = msgspec.json.decode(data).get("error", {}).get("code")
    except (msgspec.DecodeError, AttributeError):
        return False
    return code in ("draining", "leased")


async def relay_stream(
    request: web.Request, upstream: aiohttp.ClientResponse, on_first_chunk: Callable[[], None]
) -> web.StreamResponse:
    """SSE relayed as it arrives; an engine that dies mid-stream becomes an SSE error event."""
    resp = web.StreamResponse(
        status=upstream.status,
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    await resp.prepare(request)
    try:
        first = True
        async for chunk in upstream.content.iter_any():
            await resp.write(chunk)
            if first:
                first = False
                on_first_chunk()
    except ConnectionResetError:
        return resp  # our client went away: leaving closes the upstream, and the engine cancels
    except _UPSTREAM_ERRORS:
        event = msgspec.json.encode(crashed_error().to_openai())
        with contextlib.suppress(ConnectionResetError):
            await resp.write(b"data: " + event + b"\n\n")
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp
