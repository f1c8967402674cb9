"""Server-sent events in OpenAI's framing: `data: {json}\\n\\n`, ending with `data: [DONE]`."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import msgspec
from aiohttp import web

from mlxd.protocol.process import MARK, STREAM_KEEPALIVE_ENV, USAGE_COMMENT, RequestUsage

_encoder = msgspec.json.Encoder()
log = logging.getLogger("mlxd.engine")
KEEPALIVE_ENV = STREAM_KEEPALIVE_ENV  # seconds between comments while a stream waits (process.py)
DEFAULT_KEEPALIVE_S = 3.0


def keepalive_interval(environ: Mapping[str, str] = os.environ) -> float:
    """The keep-alive interval from the environment; the default when unset or not a positive number."""
    raw = environ.get(KEEPALIVE_ENV)
    if raw is None:
        return DEFAULT_KEEPALIVE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        log.warning("%s=%r is not a positive number of seconds; using %s", KEEPALIVE_ENV, raw, DEFAULT_KEEPALIVE_S)
        return DEFAULT_KEEPALIVE_S
    return value


class SSEWriter:
    """Writes one SSE response; each send is flushed to the socket at once."""

    def __init__(self, headers: Mapping[str, str] | None = None) -> None:
        self._resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                     **(headers or {})}
        )

    async def start(self, request: web.Request) -> web.StreamResponse:
        """Send the headers."""
        await self._resp.prepare(request)
        return self._resp

    async def write(self, data: bytes, end: bool = False) -> None:
        """Events made by `event` and friends, in one write (one HTTP chunk); `end`: the last."""
        if data:
            await self._resp.write(data)
        if end:
            await self._resp.write_eof()

    async def comment(self, text: str) -> None:
        """An SSE comment line: clients' event decoders skip it, but it shows the connection lives."""
        await self._resp.write(b": " + text.encode() + b"\n\n")


DONE = b"data: [DONE]\n\n"


def event(obj: Any) -> bytes:
    """One `data:` event with `obj` as JSON."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def usage_comment(usage: RequestUsage) -> bytes:
    """The request's cost, as the comment the supervisor reads (process.USAGE_COMMENT)."""
    return USAGE_COMMENT + _encoder.encode(usage) + b"\n\n"


def mark(index: int, total: int, ids: list[int], end: bool = False) -> bytes:
    """A resume mark (process.MARK): the token ids the events before it carried; `end`: they
    closed their choice (an `n` > 1 stream's choice that finished before the others)."""
    return MARK + b"%d %d %s%s\n\n" % (index, total, ",".join(map(str, ids)).encode(), b" end" if end else b"")
