"""One attempt to relay a request to an engine: connect, send, and pass the answer on,
straight through (passthrough.py) or in the caller's API (translated.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from aiohttp import web

from mlxd.protocol.process import MARKS_HEADER
from mlxd.supervisor.engines.upstream import (
    EngineUnreachable,
    Upstream,
    connect,
    crashed_error,
    request_bytes,
)
from mlxd.supervisor.relay.dialect import Dialect
from mlxd.supervisor.relay.keys import USAGE_KEY
from mlxd.supervisor.relay.passthrough import relay_stream, relay_whole
from mlxd.supervisor.relay.resume import Cut, ReplyMarks
from mlxd.supervisor.relay.translated import relay_translated, translate_whole

log = logging.getLogger("mlxd.supervisor")
DROPPED_AT_ONCE_S = 0.1  # a connection lost with no answer this soon: the engine was already dying


async def forward(
    request: web.Request, socket: Path, gate: asyncio.Semaphore, body: bytes, headers: Mapping[str, str],
    dialect: Dialect, on_first_chunk: Callable[[], None] = lambda: None,
    prepared: web.StreamResponse | None = None, marks: ReplyMarks | None = None,
) -> web.StreamResponse:
    """POST `body` to the engine at `socket` (holding one of `gate`'s slots): to the same path,
    or the dialect's engine route; relay its answer chunk by chunk (an event stream into
    `prepared` when the SSE head is out), decoded and re-encoded on the way if the dialect
    translates. EngineUnreachable when the engine was gone before it took the request. With
    `marks` (resume.py) a stream asks for resume marks, and an engine that dies mid-answer
    raises Cut rather than ending the answer with an error."""
    async with gate:
        try:
            up = await connect(socket)
        except TimeoutError:
            raise crashed_error() from None
        except OSError:  # refused, no socket file, or closed at once: nothing was sent
            raise EngineUnreachable(was_sent=False) from None
        try:
            if marks is not None:
                headers = {**headers, MARKS_HEADER: "1"}
            return await _relay(request, up, body, headers, dialect, on_first_chunk, prepared, marks)
        finally:
            up.close()
            if (usage := up.usage()) is not None:
                request[USAGE_KEY] = usage
            if up.error:
                log.warning("engine at %s sent a malformed answer to %s: %s", socket, request.path, up.error)


async def _relay(
    request: web.Request, up: Upstream, body: bytes, headers: Mapping[str, str], dialect: Dialect,
    on_first_chunk: Callable[[], None], prepared: web.StreamResponse | None, marks: ReplyMarks | None,
) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    connected = loop.time()
    up.send(request_bytes(dialect.engine_path or request.path_qs, body, headers))
    while up.head is None and not up.lost:
        await up.changed()
    if up.head is None:
        if up.num_received == 0 and loop.time() - connected < DROPPED_AT_ONCE_S:
            raise EngineUnreachable(was_sent=True)
        if marks is not None:
            raise Cut(prepared)
        raise crashed_error()
    if up.head.is_event_stream and up.head.status == 200:
        if dialect.translator() is not None:
            return await relay_translated(request, up, dialect, on_first_chunk, prepared, marks)
        return await relay_stream(request, up, dialect, on_first_chunk, prepared, marks)
    whole = await relay_whole(up, marks)
    dialect.engine_usage(up.usage())
    return await translate_whole(whole, dialect) if dialect.engine_path is not None else whole
