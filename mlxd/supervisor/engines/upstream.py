"""The supervisor's one engine client: one HTTP/1.1 request over an engine's Unix socket.

A small client made for this one peer (the engine is our own aiohttp server), not aiohttp's
client: a stream's chunks then go from the engine's socket to the caller's without a task
wake-up, a StreamReader or a coroutine each. `Upstream.data_received` finds the complete chunks
of the engine's chunked body and hands them, framing and all, to a sink the relay sets (which
writes them straight to the caller's transport), or keeps them for a task to take. That halves
the supervisor's CPU per relayed token (`benchmarks/relay_cpu.py`). Each request opens its own
connection and asks the engine to close it (`Connection: close`): a Unix-socket connect costs
less than a pooled connection's bookkeeping, and a connection never outlives the request that
owns it. Relayed requests, health and stats calls, drains and lease streams all come here.
"""

from __future__ import annotations

import asyncio
import collections
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import cast

import msgspec

from mlxd.protocol.errors import APIError
from mlxd.protocol.process import REFUSALS, USAGE_COMMENT, USAGE_HEADER, RequestUsage

_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
CRASHED = "The model's engine stopped unexpectedly; it is being restarted. Try again."
CONNECT_TIMEOUT_S = 5.0
# Connections open to one engine at once; more requests wait for one to close. Each connects
# afresh, and a burst of them all at once would overrun the engine's listen backlog (128, and
# macOS caps any backlog at 128): those connects are refused. (aiohttp's connector, used before,
# had the same cap, 100.)
MAX_ENGINE_CONNECTIONS = 100
MAX_HEAD_BYTES = 64 * 1024
HIGH_WATER = 256 * 1024  # the caller's unsent bytes past which the engine's socket is not read
LOW_WATER = 64 * 1024  # ... and below which it is read again
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


def out_of_memory_error() -> APIError:
    """What a request gets whose reply a batched step's want of device memory cut short once more
    than it may go on (the engine's own `engine_out_of_memory`, with resume on)."""
    return APIError(500, "The model ran out of device memory while answering, and again each time it went on; "
                    "try again with a shorter prompt or fewer requests at once.", type="server_error", code="engine_out_of_memory",
                    headers={"Retry-After": "1"})


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

    def send(self, data: bytes) -> None:
        """Write the request (once connected)."""
        assert self.transport is not None
        self.transport.write(data)

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


async def connect(socket: Path) -> Upstream:
    """A connection to the engine at `socket`, nothing sent yet. OSError when nothing listens
    there or it closed the connection at once; TimeoutError after CONNECT_TIMEOUT_S."""
    loop = asyncio.get_running_loop()
    transport, up = await asyncio.wait_for(loop.create_unix_connection(Upstream, str(socket)), CONNECT_TIMEOUT_S)
    if up.lost or transport.is_closing():
        # The engine died between accept and now. uvloop's write on a closed transport raises
        # RuntimeError where asyncio's only warns, so this is checked before any write.
        raise ConnectionResetError("the engine closed the connection at once")
    return up


async def open_upstream(
    socket: Path, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None,
) -> Upstream:
    """Connect to the engine at `socket` and send one request; the answer fills the returned
    Upstream as it comes (the caller closes it). OSError when nothing listens there."""
    up = await connect(socket)
    up.send(request_bytes(path, body, headers or {}, method))
    return up


async def call(socket: Path, method: str, path: str, body: bytes = b"", timeout_s: float = 2.0) -> tuple[int, bytes]:
    """One whole request to an engine (its health, stats, drain): the status and body.

    Raises TimeoutError, OSError, or UpstreamError
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


def is_busy(data: bytes) -> bool:
    """An engine's 503 `draining` or `leased`: nothing ran, so the request can wait and retry."""
    try:
        code = msgspec.json.decode(data).get("error", {}).get("code")
    except (msgspec.DecodeError, AttributeError):
        return False
    return code in REFUSALS
