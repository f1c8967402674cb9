"""The translating path: the engine's chat answer turned into the caller's API on the way.

A stream is decoded event by event and re-encoded by the dialect's translator. As on the
passthrough path, when both sides speak chunked HTTP the work happens in the callback that read
the engine's bytes: its events are translated and written, framed, to the caller's transport,
with no task wake-up per token (a caller over HIGH_WATER unsent bytes pauses reading from the
engine). The task wakes to wait out a slow caller, and for the end: the closing events (after
the dialect's `on_final`, the Responses store's write), or the dialect's error events when the
engine went away. Otherwise (an HTTP/1.0 caller, compression) each batch goes through aiohttp's
`write`. A caller gone ends the upstream: the engine cancels.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
from aiohttp import web

from mlxd.protocol.chat_chunks import chunk_decoder
from mlxd.supervisor.engines.upstream import HIGH_WATER, Upstream, crashed_error
from mlxd.supervisor.relay.dialect import Dialect, StreamTranslator
from mlxd.supervisor.relay.resume import Cut, ReplyMarks
from mlxd.supervisor.relay.sse import SseEvents, is_direct, open_stream, wait_out

log = logging.getLogger("mlxd.supervisor")


async def translate_whole(resp: web.Response, dialect: Dialect) -> web.Response:
    """A whole answer in the caller's API: a success converted, an error re-encoded."""
    data = resp.body if isinstance(resp.body, bytes) else b""
    retry = {"Retry-After": resp.headers["Retry-After"]} if "Retry-After" in resp.headers else {}
    if resp.status != 200:
        err = dialect.engine_error(resp.status, data)
        err.headers.update(retry)
        raise err
    status, body = await dialect.whole(resp.status, data)
    return web.Response(status=status, body=body, content_type="application/json", headers=retry)


async def relay_translated(
    request: web.Request, up: Upstream, dialect: Dialect, on_first_chunk: Callable[[], None],
    prepared: web.StreamResponse | None = None, marks: ReplyMarks | None = None,
) -> web.StreamResponse:
    """The engine's chat stream, event by event, in the caller's API. With `marks` (a stream that
    can go on), an engine that dies mid-stream raises Cut, and a stream going on after one does
    not open again: the same translator goes on with the next engine's chunks."""
    translator = dialect.translator()
    assert translator is not None
    resp = await open_stream(request, prepared, dialect.stream_headers)
    relay = _Translating(translator, dialect, on_first_chunk, marks)
    if marks is not None:
        assert up.head is not None
        marks.head(up.head.headers)
    try:
        if marks is None or not marks.opened:
            await resp.write(translator.start())
            if marks is not None:
                marks.opened = True
        transport = request.transport
        if is_direct(up, resp) and transport is not None and not transport.is_closing():
            if not await _relay_direct(resp, up, relay, transport):
                return resp  # the caller left
        else:
            await _relay_written(resp, up, relay)
        if marks is not None and not relay.done and (up.lost or marks.stopping) and marks.resumable():
            raise Cut(resp)
        if relay.done and not translator.ended:
            closing = translator.finish()
            await dialect.on_final(translator)
            await resp.write(closing)
        if not translator.ended:  # the engine went away, or its stream ended with no [DONE]
            await resp.write(dialect.error_event(crashed_error()))
        await resp.write_eof()
    except ConnectionResetError:
        pass
    return resp


async def _relay_direct(resp: web.StreamResponse, up: Upstream, relay: _Translating,
                        transport: asyncio.Transport) -> bool:
    """Translate in the read callback until the engine's answer ends; False if the caller left."""
    first = relay.translate(up.take_body())  # what came before the sink was in place
    if first:
        await resp.write(first)
    up.payload_sink = relay.writer(transport, up)
    while not (up.ended or up.lost or relay.done):
        await up.changed()
        if transport.is_closing():
            return False
        if up.paused:
            await wait_out(transport, up)
    return True


async def _relay_written(resp: web.StreamResponse, up: Upstream, relay: _Translating) -> None:
    """Translate in this task, each batch through aiohttp's `write`."""
    while not relay.done:
        out = relay.translate(up.take_body())
        if out:
            await resp.write(out)
        if up.body:
            continue
        if up.ended or up.lost:
            return
        await up.changed()


class _Translating:
    """One translated stream's state: its SSE splitter, and whether [DONE] came."""

    def __init__(self, translator: StreamTranslator, dialect: Dialect, on_first_chunk: Callable[[], None],
                 marks: ReplyMarks | None = None) -> None:
        self.translator = translator
        self.marks = marks
        self.dialect = dialect
        self.events = SseEvents()
        self.on_first_chunk = on_first_chunk
        self.sent = False
        self.done = False  # the engine's [DONE] arrived: the task closes the stream

    def translate(self, payloads: list[bytes]) -> bytes:
        out: list[bytes] = []
        answered = False  # an event of the answer went out (not a keep-alive, which waits for it)
        if self.marks is not None:
            payloads = list(map(self.marks.take, payloads))
        for payload in payloads:
            for data in self.events.feed(payload):
                if data == b"[DONE]":
                    self.done = True
                elif not self.done:
                    event = self._event(data)
                    out.append(event)
                    answered = answered or (data is not None and bool(event))
        if answered and not self.sent:
            self.sent = True
            self.on_first_chunk()
        return b"".join(out)

    def writer(self, transport: asyncio.Transport, up: Upstream) -> Callable[[list[bytes]], None]:
        """The payload sink: translate, frame and write to the caller, in the read callback."""

        def write(payloads: list[bytes]) -> None:
            if transport.is_closing():
                up.close()
                return
            blob = self.translate(payloads)
            if blob:
                transport.write(b"%x\r\n" % len(blob) + blob + b"\r\n")
                if transport.get_write_buffer_size() > HIGH_WATER:
                    up.pause()
            if self.done or self.translator.ended:
                up.wake()

        return write

    def _event(self, data: bytes | None) -> bytes:
        """One SSE event from the engine (its data; None for a comment, a keep-alive) in the caller's API."""
        if data is None:
            return self.dialect.comment(b": keep-alive\n\n")
        if self.translator.ended:
            return b""
        try:
            chunk = chunk_decoder.decode(data)
        except msgspec.DecodeError:  # not JSON, or not a chunk's shape
            log.warning("engine sent an SSE event that is not a chat chunk: %r", data[:80])
            return b""
        if chunk.error is not None:
            return self.dialect.error_event(self.dialect.engine_error(500, data))
        return self.translator.feed(chunk)
