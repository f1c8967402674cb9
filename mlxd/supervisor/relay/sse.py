"""Server-sent events on the caller's side: the head, the splitter, and a slow caller's wait."""

from __future__ import annotations

import asyncio

from aiohttp import web

from mlxd.supervisor.engines.upstream import LOW_WATER, Upstream

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DRAIN_POLL_S = 0.005


async def open_stream(request: web.Request, prepared: web.StreamResponse | None,
                      headers: dict[str, str] = SSE_HEADERS) -> web.StreamResponse:
    """The caller's event stream: `prepared` when its head is already out, else a new one."""
    if prepared is not None:
        return prepared
    resp = web.StreamResponse(headers=headers)
    await resp.prepare(request)
    return resp


def is_direct(up: Upstream, resp: web.StreamResponse) -> bool:
    """Whether the engine's chunks can be written to the caller's transport as they are framed:
    both sides chunked (an HTTP/1.1 caller), no compression."""
    return up.is_chunked and resp.headers.get("Transfer-Encoding", "").lower() == "chunked" and not resp.compression


async def wait_out(transport: asyncio.Transport, up: Upstream) -> None:
    """A paused upstream read again once the caller's unsent bytes are below LOW_WATER."""
    while transport.get_write_buffer_size() > LOW_WATER and not transport.is_closing():
        await asyncio.sleep(DRAIN_POLL_S)
    up.resume()


class SseEvents:
    """Splits an SSE byte stream into events as pieces arrive: each event's data (its `data:`
    lines joined), or None for a comment-only event."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, piece: bytes) -> list[bytes | None]:
        buf = self._rest + piece
        *blocks, self._rest = buf.split(b"\n\n")
        out: list[bytes | None] = []
        for block in blocks:
            lines = block.split(b"\n")
            data = [line[5:].lstrip(b" ") if line.startswith(b"data:") else None for line in lines]
            kept = [d for d in data if d is not None]
            out.append(b"\n".join(kept) if kept else None)
        return out
