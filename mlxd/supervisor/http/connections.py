"""The supervisor's TCP connections: a head deadline, caps on how many are open, clean errors.

aiohttp reads a request head for as long as the client takes and keeps any number of
connections open, so 300 clients sending one byte every 5 s would hold 300 connections
forever. `GuardedHandler` is aiohttp's own protocol with three additions:
- a deadline for each request head (from the connection's start, or the first byte after
  a keep-alive pause): a slow head gets a 408 and a silent connection is closed;
- caps on open connections, in all and per peer address: at a cap, an idle connection (one
  waiting for a head) is closed to make room, the oldest first; only when every connection
  has a request running is the new one answered 503;
- malformed HTTP gets a JSON error that echoes nothing, and one log line per cause a minute.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from mlxd.http_errors import Handler
from mlxd.protocol.errors import APIError, encode_openai_error

log = logging.getLogger("mlxd.supervisor")
LOG_EVERY_S = 60.0  # one line per cause of malformed HTTP in this long (with a count of the rest)


@dataclass(frozen=True)
class ConnView:
    """What the cap policy sees of one open connection."""

    id: int
    peer: str
    opened: float
    is_idle: bool  # waiting for a request head (new, partway through one, or kept alive)


@dataclass(frozen=True)
class Admit:
    evict: int | None = None  # an idle connection to close first


@dataclass(frozen=True)
class Refuse:
    reason: str


def admit_connection(open_conns: Iterable[ConnView], peer: str, max_total: int, max_per_peer: int) -> Admit | Refuse:
    """Whether a new connection from `peer` may stay, and which idle one to close for it."""
    conns = list(open_conns)
    same_peer = [c for c in conns if c.peer == peer]
    if len(same_peer) >= max_per_peer:
        return _evict_oldest_idle(same_peer, f"{max_per_peer} connections from one address")
    if len(conns) >= max_total:
        return _evict_oldest_idle(conns, f"{max_total} connections")
    return Admit()


def _evict_oldest_idle(conns: list[ConnView], limit: str) -> Admit | Refuse:
    idle = [c for c in conns if c.is_idle]
    if not idle:
        return Refuse(f"mlxd has {limit} open, all busy; try again.")
    return Admit(evict=min(idle, key=lambda c: c.opened).id)


class RateLimitedLog:
    """One log line per cause per period; the lines it held back are counted in the next."""

    def __init__(self, every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._every_s = every_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, cause: str, detail: str) -> bool:
        """Log `cause: detail` unless `cause` was logged within the period; whether it was."""
        now = self._clock()
        last = self._last.get(cause)
        if last is not None and now - last < self._every_s:
            self._held[cause] = self._held.get(cause, 0) + 1
            return False
        self._last[cause] = now
        held = self._held.pop(cause, 0)
        more = f" (and {held} more since the last report)" if held else ""
        log.warning("%s: %s%s", cause, detail, more)
        return True


@dataclass
class ConnectionTable:
    """The open connections, shared by every handler of one server."""

    max_total: int
    max_per_peer: int
    head_timeout_s: float
    open: dict[int, GuardedHandler] = field(default_factory=dict)
    ids: Any = field(default_factory=lambda: itertools.count(1))
    errors: RateLimitedLog = field(default_factory=RateLimitedLog)
    num_refused: int = 0
    num_evicted: int = 0
    num_head_timeouts: int = 0


# A cause's name for the log and the client, by aiohttp's parser exception; never the input.
_CAUSES = {
    "BadHttpMethod": "bad method",
    "BadStatusLine": "bad request line",
    "InvalidURLError": "bad URL",
    "LineTooLong": "request line or header too long",
    "InvalidHeader": "bad header",
    "BadHttpMessage": "malformed message",
    "TransferEncodingError": "bad transfer encoding",
    "ContentLengthError": "bad content length",
    "ContentEncodingError": "bad content encoding",
}


def cause_of(exc: BaseException | None, status: int) -> str:
    """A short name of what was wrong, from the exception's class; nothing from the input."""
    if exc is None:
        return HTTPStatus(status).phrase.lower() if status in HTTPStatus._value2member_map_ else "error"
    for kind in type(exc).__mro__:
        if kind.__name__ in _CAUSES:
            return _CAUSES[kind.__name__]
    return "malformed HTTP request" if status < 500 else "internal error"


def raw_response(status: int, err: APIError) -> bytes:
    """A complete HTTP/1.1 answer that closes the connection, for when aiohttp has no request."""
    body = encode_openai_error(err)
    extra = "".join(f"{k}: {v}\r\n" for k, v in err.headers.items())
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n")
    return head.encode("latin-1") + body


class GuardedHandler(RequestHandler):
    """aiohttp's HTTP protocol with a head deadline, connection caps and JSON parse errors."""

    def __init__(self, manager: web.Server, table: ConnectionTable, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._table = table
        self._id = next(table.ids)
        self._peer = "?"
        self._opened = time.monotonic()
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0

    def view(self) -> ConnView:
        return ConnView(self._id, self._peer, self._opened, self.is_waiting_for_head())

    def is_waiting_for_head(self) -> bool:
        """No request being handled or queued: the connection waits for (the rest of) a head."""
        waiter = self._waiter
        return waiter is not None and not waiter.done() and not self._messages

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        self._peer = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        table = self._table
        decision = admit_connection((h.view() for h in table.open.values()), self._peer,
                                    table.max_total, table.max_per_peer)
        if isinstance(decision, Refuse):
            table.num_refused += 1
            table.errors.warning("connection refused", f"from {self._peer}: {decision.reason}")
            err = APIError(503, decision.reason, type="server_error", code="too_many_connections",
                           headers={"Retry-After": "1"})
            self._close_with(raw_response(503, err))
            return
        if decision.evict is not None and (victim := table.open.get(decision.evict)) is not None:
            table.num_evicted += 1
            victim.force_close()
        table.open[self._id] = self
        self._arm_head_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._table.open.pop(self._id, None)
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self.is_waiting_for_head() and not self._request_in_progress:
            self._arm_head_timer()  # the first bytes of the next head on a kept-alive connection
        self._head_bytes += len(data)
        super().data_received(data)
        if self._messages:
            self._cancel_head_timer()  # a whole head (or a parse error, answered at once)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_bytes = 0
        self._head_timer = self._loop.call_later(self._table.head_timeout_s, self._on_head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if not self.is_waiting_for_head() or self._request_in_progress:
            return  # a request is running: the deadline was for a head that arrived
        if self._head_bytes == 0:
            self.force_close()  # a silent connection (new, or kept alive): nothing to answer
            return
        self._table.num_head_timeouts += 1
        seconds = f"{self._table.head_timeout_s:g}"
        err = APIError(408, f"The request head did not arrive within {seconds} s.", code="request_timeout")
        self._close_with(raw_response(408, err))

    def _close_with(self, answer: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(answer)
        self.force_close()

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """aiohttp's parse and last-resort errors as JSON that echoes nothing; one log line per cause."""
        cause = cause_of(exc, status)
        what = "malformed HTTP request" if status < 500 else "request failed"
        self._table.errors.warning(f"{what} ({cause})", f"from {self._peer}")
        if request.writer.output_size > 0:
            raise ConnectionError("the answer had begun; the connection is closed")
        kind = "invalid_request_error" if status < 500 else "server_error"
        text = f"Malformed HTTP request ({cause})." if status < 500 else "Internal error in the supervisor."
        err = APIError(status, text, type=kind, code="bad_http_request" if status < 500 else None)
        resp = web.Response(status=status, body=encode_openai_error(err), content_type="application/json")
        resp.force_close()
        return resp


def make_protocol_factory(server: web.Server, table: ConnectionTable) -> Callable[[], GuardedHandler]:
    """What the listening socket calls per connection: a GuardedHandler bound to `server`."""
    kwargs = dict(server._kwargs)  # what AppRunner was given (timeouts, access log): same as aiohttp's own

    def make() -> GuardedHandler:
        return GuardedHandler(server, table, loop=server._loop, **kwargs)

    return make


class GuardedSite(web.BaseSite):
    """A TCP site (like aiohttp's TCPSite) whose connections are GuardedHandlers."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, table: ConnectionTable, backlog: int = 1024) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._table = host, port, table

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            make_protocol_factory(server, self._table), self._host, self._port,
            backlog=self._backlog, reuse_address=True,
        )


def make_body_middleware(max_bytes: int, timeout_s: float) -> Middleware:
    """413 from a too-large Content-Length before any body is read; 408 for a body that stalls.

    The body is read here, within the deadline, and aiohttp keeps it for the handler's own read.
    """

    @web.middleware
    async def read_body(request: web.Request, handler: Handler) -> web.StreamResponse:
        length = request.content_length
        if length is not None and length > max_bytes:
            raise APIError(413, f"Request body too large: {length} bytes, over the limit of {max_bytes}.",
                           code="request_too_large")
        if request.can_read_body:
            try:
                async with asyncio.timeout(timeout_s):
                    await request.read()
            except TimeoutError:
                raise APIError(408, f"The request body did not arrive within {timeout_s:g} s.",
                               code="request_timeout", headers={"Connection": "close"}) from None
        return await handler(request)

    return read_body
