"""The fast path: an OpenAI request's answer relayed from the engine as it came, unparsed.

The first payloads go through aiohttp's `write` (which sends the head with them). After that,
when both sides speak chunked encoding (an HTTP/1.1 caller, no compression), the upstream
protocol writes the engine's framed chunks to the caller's transport itself, in the callback
that read them, and the relaying task only wakes to wait out a slow caller, and at the end.
Otherwise (an HTTP/1.0 caller, say, whose body runs to the close) every payload goes through
`write`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from aiohttp import web

from mlxd.supervisor.engines.upstream import (
    HIGH_WATER,
    EngineBusy,
    Upstream,
    crashed_error,
    is_busy,
    whole_body,
)
from mlxd.supervisor.relay.dialect import Dialect
from mlxd.supervisor.relay.resume import OUT_OF_MEMORY, Cut, ReplyMarks, is_cut_short
from mlxd.supervisor.relay.sse import is_direct, open_stream, wait_out


async def relay_whole(up: Upstream, marks: ReplyMarks | None = None) -> web.Response:
    """A non-streaming answer, passed through as-is; with `marks`, an engine lost meanwhile is a
    Cut (the request may start over)."""
    data = await whole_body(up)
    if up.lost:
        if marks is not None:
            raise Cut(None)
        raise crashed_error()
    assert up.head is not None
    if up.head.status == 503 and is_busy(data):
        raise EngineBusy
    if up.head.status >= 500 and marks is not None and is_cut_short(data):
        marks.out_of_memory = OUT_OF_MEMORY in data
        raise Cut(None)  # a drain's timeout or a shutdown cut it short: worked out again on the next engine
    headers = {"Content-Type": up.head.headers.get("content-type", "application/octet-stream")}
    if "retry-after" in up.head.headers:
        headers["Retry-After"] = up.head.headers["retry-after"]
    return web.Response(status=up.head.status, body=data, headers=headers)


async def relay_stream(
    request: web.Request, up: Upstream, dialect: Dialect, on_first_chunk: Callable[[], None],
    prepared: web.StreamResponse | None = None, marks: ReplyMarks | None = None,
) -> web.StreamResponse:
    """SSE relayed as it arrives; an engine that dies mid-stream ends it with the dialect's error
    event, or (`marks`: a stream that can go on) raises Cut. Its resume marks are stripped."""
    resp = await open_stream(request, prepared)  # only a 200 stream comes here
    direct = is_direct(up, resp)
    if marks is not None:
        assert up.head is not None
        marks.head(up.head.headers)
    try:
        await _write_payloads(resp, up, on_first_chunk, until_first=direct, marks=marks)
        if direct and not up.ended and not up.lost:
            transport = request.transport
            if transport is None or transport.is_closing():
                return resp  # our caller went away: leaving closes the upstream, and the engine cancels
            if marks is not None:
                up.payload_sink = _marked_writer(transport, up, marks)
            else:
                up.sink = _direct_writer(transport, up)
            while not up.ended and not up.lost:
                await up.changed()
                if up.paused:
                    await wait_out(transport, up)
            if transport.is_closing():
                return resp
    except ConnectionResetError:
        return resp
    if marks is not None and (up.lost or marks.stopping) and marks.resumable():
        raise Cut(resp)
    if up.lost or (marks is not None and marks.stopping):
        with contextlib.suppress(ConnectionResetError):
            await resp.write(dialect.error_event(crashed_error()))
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


async def _write_payloads(
    resp: web.StreamResponse, up: Upstream, on_first_chunk: Callable[[], None], until_first: bool,
    marks: ReplyMarks | None = None,
) -> None:
    """Payloads through `resp.write` until the answer ends, or (`until_first`) none is left after the
    first event (SSE comments, the engine's keep-alives while a request waits, do not count)."""
    sent = False
    while True:
        body = up.take_body()
        if marks is not None:
            body = [kept for kept in map(marks.take, body) if kept]
        for payload in body:
            await resp.write(payload)
        if not sent and any(not payload.startswith(b":") for payload in body):
            sent = True
            on_first_chunk()
        if up.body:
            continue  # more arrived while writing
        if up.ended or up.lost or (sent and until_first):
            return
        await up.changed()


def _direct_writer(transport: asyncio.Transport, up: Upstream) -> Callable[[bytes], None]:
    """Writes already-framed chunks to the caller; a caller gone ends the upstream, a slow one pauses it."""

    def write(framed: bytes) -> None:
        if transport.is_closing():
            up.close()
            return
        transport.write(framed)
        if transport.get_write_buffer_size() > HIGH_WATER:
            up.pause()

    return write


def _marked_writer(transport: asyncio.Transport, up: Upstream, marks: ReplyMarks) -> Callable[[list[bytes]], None]:
    """`_direct_writer` for a stream with resume marks: each payload's mark kept and stripped,
    the rest framed again and written to the caller."""

    def write(payloads: list[bytes]) -> None:
        if transport.is_closing():
            up.close()
            return
        framed = [b"%x\r\n%b\r\n" % (len(kept), kept) for kept in map(marks.take, payloads) if kept]
        if framed:
            transport.write(b"".join(framed))
            if transport.get_write_buffer_size() > HIGH_WATER:
                up.pause()

    return write
