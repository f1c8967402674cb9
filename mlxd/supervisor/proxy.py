"""Relay a request to an engine over its Unix socket, streaming the answer back unparsed.

The upstream side is a small HTTP/1.1 client made for this one peer (the engine is our own
aiohttp server), not aiohttp's client: a stream's chunks then go from the engine's socket to the
caller's without a task wake-up, a StreamReader or a coroutine each. `Upstream.data_received`
finds the complete chunks of the engine's chunked body and writes them, framing and all, straight
to the caller's transport when the caller's response is chunked too (HTTP/1.1; an HTTP/1.0
caller gets the payloads through aiohttp's writer instead). That halves the supervisor's CPU
per relayed token (`benchmarks/relay_cpu.py`). Each request opens its own connection and asks
the engine to close it (`Connection: close`): a Unix-socket connect costs less than a pooled
connection's bookkeeping, and a connection never outlives the request that owns it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import cast

import msgspec
from aiohttp import web

from mlxd.protocol.errors import APIError
from mlxd.protocol.process import REFUSALS, USAGE_COMMENT, USAGE_HEADER, RequestUsage
from mlxd.supervisor.dialects import StreamTranslator, Translation, engine_error

log = logging.getLogger("mlxd.supervisor")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
CRASHED = "The model's engine stopped unexpectedly; it is being restarted. Try again."
CONNECT_TIMEOUT_S = 5.0
DROPPED_AT_ONCE_S = 0.1  # a connection lost with no answer this soon: the engine was already dying
# Connections open to one engine at once; more requests wait for one to close. Each connects
# afresh, and a burst of them all at once would overrun the engine's listen backlog (128, and
# macOS caps any backlog at 128): those connects are refused. (aiohttp's connector, used before,
# had the same cap, 100.)
MAX_ENGINE_CONNECTIONS = 100
MAX_HEAD_BYTES = 64 * 1024
HIGH_WATER = 256 * 1024  # the caller's unsent bytes past which the engine's socket is not read
LOW_WATER = 64 * 1024  # ... and below which it is read again
DRAIN_POLL_S = 0.005
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


USAGE_KEY = web.RequestKey("mlxd.usage", RequestUsage)  # the engine's report of the answer relayed (if any)
_usage_decoder = msgspec.json.Decoder(RequestUsage)


class EngineBusy(Exception):
    """The engine turned the request away before starting it (draining or leased): queue it again."""


class EngineUnreachable(EngineBusy):
    """The engine died before it could take the request; its owner has not seen the exit yet.

    Either nothing listens on its socket (nothing was sent), or the connection was dropped at
    once with no answer: a process being torn down after SIGKILL still holds its listening
    socket for a moment, and takes a connection it will never read
    (test_engine_sigkill_mid_stream_ends_the_stream_cleanly_and_the_next_request_works).
    The request may wait for the restart like any other; `was_sent` ones only once, so that
    a request that itself kills engines is not sent to every new one.
    """

    def __init__(self, was_sent: bool) -> None:
        super().__init__()
        self.was_sent = was_sent


class UpstreamError(Exception):
    """The engine's connection failed or ended early, or it answered something that is not HTTP."""


def crashed_error() -> APIError:
    """What a request in flight on a dying engine gets."""
    return APIError(502, CRASHED, type="server_error", code="engine_crashed", headers={"Retry-After": "1"})


class Head(msgspec.Struct, frozen=True):
    """The engine's status line and headers (names lower-cased)."""

    status: int
    headers: dict[str, str]

    @property
    def is_event_stream(self) -> bool:
        return self.headers.get("content-type", "").split(";")[0].strip() == "text/event-stream"


def parse_head(raw: bytes) -> Head:
    """`HTTP/1.1 200 OK\\r\\nName: value\\r\\n...` (without the blank line) into a Head."""
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise UpstreamError(f"not an HTTP response: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise UpstreamError(f"bad header line: {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    return Head(int(code), headers)


class ChunkedBody:
    """Splits an HTTP/1.1 chunked body into whole chunks as bytes arrive in any pieces."""

    def __init__(self) -> None:
        self._rest = b""
        self.done = False

    def feed(self, data: bytes, payloads: list[bytes] | None = None) -> bytes:
        """The complete chunks in `data` (plus what was held back), framed as they came.

        Their payloads are appended to `payloads` if given. A chunk split across reads is held
        back until it is whole; the terminating zero-size chunk (and any trailer) sets `done`
        and is not returned.
        """
        if self._rest:
            data, self._rest = self._rest + data, b""
        pos = 0
        while not self.done:
            eol = data.find(b"\r\n", pos)
            if eol < 0:
                if len(data) - pos > 1024:
                    raise UpstreamError("chunk size line too long")
                break
            digits = data[pos:eol].split(b";", 1)[0]
            if not _HEX.fullmatch(digits):
                raise UpstreamError(f"bad chunk size line: {data[pos:eol][:40]!r}")
            size = int(digits, 16)
            if size == 0:
                if data.find(b"\r\n\r\n", eol) < 0:  # trailers end with a blank line
                    break
                self.done = True
                return data[:pos]
            end = eol + 2 + size
            if len(data) < end + 2:
                break
            if data[end:end + 2] != b"\r\n":
                raise UpstreamError("chunk not followed by CRLF")
            if payloads is not None:
                payloads.append(data[eol + 2:end])
            pos = end + 2
        self._rest = data[pos:]
        return data[:pos]


class Upstream(asyncio.Protocol):
    """One request's connection to the engine: the head, then the body, kept or passed on.

    Until `sink` is set the body's payloads collect in `body` (reading pauses while more than
    HIGH_WATER bytes wait there); with a sink each read's complete chunks go to it as one framed
    piece of bytes, at once. `changed()` wakes the relaying task on anything it must act on: the
    head, body, the end (clean or not), or a paused read.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.head: Head | None = None
        self.body: list[bytes] = []
        self._held = 0  # bytes in `body`
        self.ended = False  # the whole answer arrived
        self.lost = False  # the connection closed before that
        self.error: str | None = None
        self.sink: Callable[[bytes], None] | None = None
        # or: each read's complete payloads, unframed (the translating relay's)
        self.payload_sink: Callable[[list[bytes]], None] | None = None
        self.paused = False
        self._head_buf = b""
        self._chunked: ChunkedBody | None = None
        self._length: int | None = None  # bytes of a Content-Length body still to come
        self._waiter: asyncio.Future[None] | None = None
        self.num_received = 0
        self._recent: collections.deque[bytes] = collections.deque(maxlen=4)  # the last reads, for usage()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.num_received += len(data)
        self._recent.append(data)
        try:
            if self.head is None:
                data = self._take_head(data)
            if self.head is not None and data:
                self._take_body(data)
        except UpstreamError as exc:
            self.error = str(exc)
            self.close()
            self._wake()
            return
        if (self.sink is None and self.payload_sink is None) or self.ended:  # with a sink, the task sleeps
            self._wake()

    def eof_received(self) -> bool | None:
        if self.head is not None and self._chunked is None and self._length is None:
            self.ended = True  # a body that runs to the end of the connection
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended:
            self.lost = True
        self._wake()

    # the relaying task's side

    async def changed(self) -> None:
        """Until something happens (returns at once when the answer is over)."""
        if self.ended or self.lost:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    @property
    def is_chunked(self) -> bool:
        """Whether the body is chunked (only then can a sink take it)."""
        return self._chunked is not None

    def take_body(self) -> list[bytes]:
        """The payloads that arrived since the last call (reading resumes if they had paused it)."""
        body, self.body, self._held = self.body, [], 0
        if self.sink is None and self.payload_sink is None:
            self.resume()
        return body

    def pause(self) -> None:
        if self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()
            self._wake()

    def resume(self) -> None:
        if self.transport is not None and self.paused:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def usage(self) -> RequestUsage | None:
        """What the generation cost, as the engine reported it (process.USAGE_HEADER / USAGE_COMMENT)."""
        raw: bytes | None = None
        if self.head is not None and (header := self.head.headers.get(USAGE_HEADER.lower())):
            raw = header.encode()
        elif self.ended and (tail := b"".join(self._recent)) and (at := tail.rfind(USAGE_COMMENT)) >= 0:
            start = at + len(USAGE_COMMENT)
            raw = tail[start:tail.find(b"\n", start)]
        try:
            return _usage_decoder.decode(raw) if raw else None
        except msgspec.DecodeError:
            return None

    # parsing

    def _take_head(self, data: bytes) -> bytes:
        buf = self._head_buf + data
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD_BYTES:
                raise UpstreamError("response head too large")
            self._head_buf = buf
            return b""
        self.head = parse_head(buf[:end])
        self._head_buf = b""
        if self.head.headers.get("transfer-encoding", "").lower() == "chunked":
            self._chunked = ChunkedBody()
        elif "content-length" in self.head.headers:
            try:
                self._length = int(self.head.headers["content-length"])
            except ValueError:
                raise UpstreamError("bad Content-Length") from None
            if self._length == 0 or self.head.status in (204, 304):
                self.ended = True
        return buf[end + 4:]

    def _take_body(self, data: bytes) -> None:
        if self._chunked is not None:
            if self.sink is not None:
                if framed := self._chunked.feed(data):
                    self.sink(framed)
            elif self.payload_sink is not None:
                payloads: list[bytes] = []
                self._chunked.feed(data, payloads)
                if payloads:
                    self.payload_sink(payloads)
            else:
                before = len(self.body)
                self._chunked.feed(data, self.body)
                self._hold(sum(len(b) for b in self.body[before:]))
            if self._chunked.done:
                self._end()
        elif self._length is not None:
            data = data[:self._length]
            self._length -= len(data)
            self.body.append(data)
            self._hold(len(data))
            if self._length == 0:
                self._end()
        elif data:
            self.body.append(data)
            self._hold(len(data))

    def _end(self) -> None:
        """The whole answer is here: the connection has done its work."""
        self.ended = True
        self.close()

    def _hold(self, num_bytes: int) -> None:
        self._held += num_bytes
        if self._held > HIGH_WATER:
            self.pause()

    def wake(self) -> None:
        """Wake the relaying task (a sink that needs it to act)."""
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def request_bytes(path_qs: str, body: bytes, headers: Mapping[str, str], method: str = "POST") -> bytes:
    """The upstream request: `body` (JSON), closing the connection after the answer."""
    lines = [f"{method} {path_qs} HTTP/1.1", "Host: engine", "Content-Type: application/json",
             f"Content-Length: {len(body)}", "Connection: close"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} has a line break")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def open_upstream(
    socket: Path, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None,
) -> Upstream:
    """Connect to the engine at `socket` and send one request; the answer fills the returned
    Upstream as it comes (the caller closes it). OSError when nothing listens there."""
    loop = asyncio.get_running_loop()
    transport, up = await asyncio.wait_for(loop.create_unix_connection(Upstream, str(socket)), CONNECT_TIMEOUT_S)
    if up.lost or transport.is_closing():
        raise ConnectionResetError("the engine closed the connection at once")
    transport.write(request_bytes(path, body, headers or {}, method))
    return up


async def call(socket: Path, method: str, path: str, body: bytes = b"", timeout_s: float = 2.0) -> tuple[int, bytes]:
    """One whole request to an engine (its health, stats, drain): the status and body.

    The supervisor's one engine client is this module's: relayed requests, these calls and
    the lease stream all go through Upstream. Raises TimeoutError, OSError, or UpstreamError
    for an answer cut short or not HTTP.
    """
    async with asyncio.timeout(timeout_s):
        up = await open_upstream(socket, method, path, body)
        try:
            data = await whole_body(up)
            if up.error:
                raise UpstreamError(up.error)
            if up.head is None or not up.ended:
                raise UpstreamError("the engine closed the connection before its answer ended")
            return up.head.status, data
        finally:
            up.close()


async def whole_body(up: Upstream) -> bytes:
    """The answer's body, once it ended or the connection was lost (then what came)."""
    parts: list[bytes] = []
    while True:
        parts += up.take_body()
        if up.ended or up.lost:
            return b"".join(parts)
        await up.changed()


def connection_gate() -> asyncio.Semaphore:
    """One per engine: at most MAX_ENGINE_CONNECTIONS of its requests are connected at once."""
    return asyncio.Semaphore(MAX_ENGINE_CONNECTIONS)


async def forward(
    request: web.Request, socket: Path, gate: asyncio.Semaphore, body: bytes, headers: Mapping[str, str],
    on_first_chunk: Callable[[], None] = lambda: None, prepared: web.StreamResponse | None = None,
    translation: Translation | None = None,
) -> web.StreamResponse:
    """POST `body` to the same path on the engine at `socket` (holding one of `gate`'s slots);
    relay its answer chunk by chunk (an event stream into `prepared` when the SSE head is out).
    With a `translation`, the body goes to its engine route, and the answer is decoded and
    re-encoded in the caller's API on the way."""
    async with gate:
        return await _forward(request, socket, body, headers, on_first_chunk, prepared, translation)


async def _forward(
    request: web.Request, socket: Path, body: bytes, headers: Mapping[str, str], on_first_chunk: Callable[[], None],
    prepared: web.StreamResponse | None, translation: Translation | None,
) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    try:
        transport, up = await asyncio.wait_for(loop.create_unix_connection(Upstream, str(socket)), CONNECT_TIMEOUT_S)
    except TimeoutError:
        raise crashed_error() from None
    except OSError:  # refused, or no socket file: nothing was sent
        raise EngineUnreachable(was_sent=False) from None
    connected = loop.time()
    try:
        if up.lost or transport.is_closing():
            # Lost between connect and write (the engine died): nothing was sent. uvloop's
            # write on a closed transport raises RuntimeError where asyncio's only warns.
            raise EngineUnreachable(was_sent=False)
        path = translation.path if translation is not None else request.path_qs
        transport.write(request_bytes(path, body, headers))
        while up.head is None and not up.lost:
            await up.changed()
        if up.head is None:
            if up.num_received == 0 and loop.time() - connected < DROPPED_AT_ONCE_S:
                raise EngineUnreachable(was_sent=True)
            raise crashed_error()
        if up.head.is_event_stream and up.head.status == 200:
            if translation is not None and translation.stream is not None:
                return await relay_translated(request, up, translation, on_first_chunk, prepared)
            return await relay_stream(request, up, on_first_chunk, prepared)
        whole = await relay_whole(up)
        return await translate_whole(whole, translation) if translation is not None else whole
    finally:
        up.close()
        if (usage := up.usage()) is not None:
            request[USAGE_KEY] = usage
        if up.error:
            log.warning("engine at %s sent a malformed answer to %s: %s", socket, request.path, up.error)


async def relay_whole(up: Upstream) -> web.Response:
    """A non-streaming answer, passed through as-is."""
    data = await whole_body(up)
    if up.lost:
        raise crashed_error()
    assert up.head is not None
    if up.head.status == 503 and is_busy(data):
        raise EngineBusy
    headers = {"Content-Type": up.head.headers.get("content-type", "application/octet-stream")}
    if "retry-after" in up.head.headers:
        headers["Retry-After"] = up.head.headers["retry-after"]
    return web.Response(status=up.head.status, body=data, headers=headers)


def is_busy(data: bytes) -> bool:
    """An engine's 503 `draining` or `leased`: nothing ran, so the request can wait and retry."""
    try:
        code = msgspec.json.decode(data).get("error", {}).get("code")
    except (msgspec.DecodeError, AttributeError):
        return False
    return code in REFUSALS


async def relay_stream(
    request: web.Request, up: Upstream, on_first_chunk: Callable[[], None], prepared: web.StreamResponse | None = None
) -> web.StreamResponse:
    """SSE relayed as it arrives; an engine that dies mid-stream becomes an SSE error event.

    The first payloads go through aiohttp's `write` (which sends the head with them). After
    that, when both sides speak chunked encoding (an HTTP/1.1 caller, no compression), the
    upstream protocol writes the engine's framed chunks to the caller's transport itself, and
    this task only wakes to wait out a slow caller, and at the end. Otherwise (an HTTP/1.0
    caller, say, whose body runs to the close) every payload goes through `write`.
    """
    resp = prepared or web.StreamResponse(headers=SSE_HEADERS)  # only a 200 stream comes here
    if prepared is None:
        await resp.prepare(request)
    direct = up.is_chunked and resp.headers.get("Transfer-Encoding", "").lower() == "chunked" and not resp.compression
    try:
        await _write_payloads(resp, up, on_first_chunk, until_first=direct)
        if direct and not up.ended and not up.lost:
            transport = request.transport
            if transport is None or transport.is_closing():
                return resp  # our caller went away: leaving closes the upstream, and the engine cancels
            up.sink = _direct_writer(transport, up)
            while not up.ended and not up.lost:
                await up.changed()
                if up.paused:
                    while transport.get_write_buffer_size() > LOW_WATER and not transport.is_closing():
                        await asyncio.sleep(DRAIN_POLL_S)
                    up.resume()
            if transport.is_closing():
                return resp
    except ConnectionResetError:
        return resp
    if up.lost:
        event = msgspec.json.encode(crashed_error().to_openai())
        with contextlib.suppress(ConnectionResetError):
            await resp.write(b"data: " + event + b"\n\n")
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


async def _write_payloads(
    resp: web.StreamResponse, up: Upstream, on_first_chunk: Callable[[], None], until_first: bool
) -> None:
    """Payloads through `resp.write` until the answer ends, or (`until_first`) none is left after the
    first event (SSE comments, the engine's keep-alives while a request waits, do not count)."""
    sent = False
    while True:
        body = up.take_body()
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


async def translate_whole(resp: web.Response, translation: Translation) -> web.Response:
    """A whole answer in the caller's API: a success converted, an error re-encoded."""
    data = resp.body if isinstance(resp.body, bytes) else b""
    retry = {"Retry-After": resp.headers["Retry-After"]} if "Retry-After" in resp.headers else {}
    if resp.status != 200:
        err = translation.error(resp.status, data)
        err.headers.update(retry)
        return translation.dialect.error_response(err)
    status, body = await translation.whole(resp.status, data)
    return web.Response(status=status, body=body, content_type="application/json", headers=retry)


async def relay_translated(
    request: web.Request, up: Upstream, translation: Translation, on_first_chunk: Callable[[], None],
    prepared: web.StreamResponse | None = None,
) -> web.StreamResponse:
    """The engine's chat stream decoded event by event and re-encoded in the caller's API.

    As on the direct path, when both sides speak chunked HTTP the work happens in the callback
    that read the engine's bytes: its events are translated and written, framed, to the
    caller's transport, with no task wake-up per token (a caller over HIGH_WATER unsent bytes
    pauses reading from the engine). The task wakes to wait out a slow caller, and for the end:
    the closing events (after the Responses store's write, `on_final`), or the caller's API's
    error event when the engine went away. Otherwise (an HTTP/1.0 caller, compression) each
    batch goes through aiohttp's `write`. A caller gone ends the upstream: the engine cancels.
    """
    assert translation.stream is not None
    resp = prepared or web.StreamResponse(headers=SSE_HEADERS)
    if prepared is None:
        await resp.prepare(request)
    translator = translation.stream()
    relay = _Translating(translator, on_first_chunk)
    try:
        await resp.write(translator.start())
        direct = up.is_chunked and resp.headers.get("Transfer-Encoding", "").lower() == "chunked" and not resp.compression
        transport = request.transport
        if direct and transport is not None and not transport.is_closing():
            first = relay.translate(up.take_body())  # what came before the sink was in place
            if first:
                await resp.write(first)
            up.payload_sink = relay.writer(transport, up)
            while not (up.ended or up.lost or relay.done):
                await up.changed()
                if transport.is_closing():
                    return resp
                if up.paused:
                    while transport.get_write_buffer_size() > LOW_WATER and not transport.is_closing():
                        await asyncio.sleep(DRAIN_POLL_S)
                    up.resume()
        else:
            while not relay.done:
                out = relay.translate(up.take_body())
                if out:
                    await resp.write(out)
                if up.body:
                    continue
                if up.ended or up.lost:
                    break
                await up.changed()
        if relay.done and not translator.ended:
            closing = translator.finish()
            if translation.on_final is not None:
                await translation.on_final(translator)
            await resp.write(closing)
        if not translator.ended:  # the engine went away, or its stream ended with no [DONE]
            err = crashed_error()
            await resp.write(translator.fail(err.status, err.message, err.code))
        await resp.write_eof()
    except ConnectionResetError:
        pass
    return resp


class _Translating:
    """One translated stream's state: its SSE splitter, and whether [DONE] came."""

    def __init__(self, translator: StreamTranslator, on_first_chunk: Callable[[], None]) -> None:
        self.translator = translator
        self.events = SseEvents()
        self.on_first_chunk = on_first_chunk
        self.sent = False
        self.done = False  # the engine's [DONE] arrived: the task closes the stream

    def translate(self, payloads: list[bytes]) -> bytes:
        out: list[bytes] = []
        for payload in payloads:
            for data in self.events.feed(payload):
                if data == b"[DONE]":
                    self.done = True
                elif not self.done:
                    out.append(_translate_event(data, self.translator))
        blob = b"".join(out)
        if blob and not self.sent:
            self.sent = True
            self.on_first_chunk()
        return blob

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


def _translate_event(data: bytes | None, translator: StreamTranslator) -> bytes:
    """One SSE event from the engine (its data; None for a comment, a keep-alive) in the caller's API."""
    if data is None:
        return b": keep-alive\n\n"
    if translator.ended:
        return b""
    try:
        chunk = msgspec.json.decode(data)
    except msgspec.DecodeError:
        log.warning("engine sent an SSE event that is not JSON: %r", data[:80])
        return b""
    if not isinstance(chunk, dict):
        return b""
    if "error" in chunk:
        err = engine_error(500, data)
        return translator.fail(err.status, err.message, err.code)
    return translator.feed(chunk)


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
