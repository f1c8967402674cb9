"""Server-sent events in OpenAI's framing: `data: {json}\\n\\n`, ending with `data: [DONE]`."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from mlxd.protocol.errors import APIError

_encoder = msgspec.json.Encoder()


class SSEWriter:
    """Writes one SSE response; each send is flushed to the socket at once."""

    def __init__(self) -> None:
        self._resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    async def start(self, request: web.Request) -> web.StreamResponse:
        """Send the headers."""
        await self._resp.prepare(request)
        return self._resp

    async def send(self, obj: Any) -> None:
        """One `data:` event with `obj` as JSON."""
        await self._resp.write(b"data: " + _encoder.encode(obj) + b"\n\n")

    async def send_error(self, err: APIError) -> None:
        """An error event in OpenAI's error shape, then end the stream (no [DONE])."""
        await self.send(err.to_openai())
        await self._resp.write_eof()

    async def done(self) -> None:
        """The closing `data: [DONE]` sentinel."""
        await self._resp.write(b"data: [DONE]\n\n")
        await self._resp.write_eof()
