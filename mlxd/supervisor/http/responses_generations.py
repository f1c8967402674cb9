"""Stored Responses generations that outlive the supervisor: recorded while they are made, and
continued when a client asks for one a restart cut off (docs/resume.md).

A stored response (`store` true, the default) gets a row in the store's `generations` table
when it starts: its Responses request and the chat request sent to its engine. While a stream
runs, the reply's token ids so far (the engine's resume marks, relay/resume.py) are saved
every `SAVE_EVERY_S`. Storing the finished response deletes the row; so does an error that
ends the request. A supervisor killed mid-reply (or a caller that left) leaves the row, and a client that then
asks for the response (`GET /v1/responses/{id}`) gets it finished: the chat request goes to the
model's engine again with `resume` set to the saved tokens, so the engine goes on after them
(with a generation checkpoint on SSD, prefilling only what followed it), and the response is
stored and answered whole, or with `?stream=true` as a stream from its start: the engine
resends the delivered part (`resume.resend`), then streams the rest as it is made.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from mlxd.protocol import responses
from mlxd.protocol.errors import APIError
from mlxd.protocol.json_body import decode_json
from mlxd.supervisor.http.relaying import relay, resolve_target
from mlxd.supervisor.relay.keys import MARKS_KEY
from mlxd.supervisor.relay.responses_dialect import Keep, Responses
from mlxd.supervisor.response_store import AsyncStore, Generation, int_blob

log = logging.getLogger("mlxd.supervisor")
SAVE_EVERY_S = 1.0
LIVE = web.AppKey("responses_live", set)  # ids of responses this supervisor is making now
_decoder = msgspec.json.Decoder(responses.ResponsesRequest)


async def recorded(request: web.Request, store: AsyncStore, shell: responses.Shell, raw: bytes | None,
                   chat: bytes, relaying: Awaitable[web.StreamResponse]) -> web.StreamResponse:
    """Run `relaying` (a stored response's relay) with its generation row kept up to date (`raw`,
    the Responses request: the row is made first; None: it exists)."""
    live: set[str] = request.app[LIVE]
    if raw is not None:  # queued, not waited for (the store's one thread runs its calls in order: this first)
        store.submit(store.store.begin, shell.id, shell.model, shell.created_at, raw, chat).add_done_callback(
            _log_failure)
    live.add(shell.id)
    saver = asyncio.create_task(_save_progress(request, store, shell.id))
    try:
        return await relaying
    except APIError:  # an error answered whole: nothing to go on with (a caller gone keeps its row)
        if raw is not None:  # (one cut off earlier is kept: a busy or loading model may answer later)
            with contextlib.suppress(sqlite3.Error):
                await store.run(store.store.end, shell.id)
        raise
    finally:
        saver.cancel()
        live.discard(shell.id)
        with contextlib.suppress(sqlite3.Error):
            await _save(request, store, shell.id, -1)  # where a caller who left stopped (a stored one: a no-op)


def _log_failure(done: asyncio.Future[None]) -> None:
    if not done.cancelled() and (exc := done.exception()) is not None:  # it is still answered; a restart loses it
        log.error("responses: recording a generation failed: %s", exc)


async def _save_progress(request: web.Request, store: AsyncStore, rid: str) -> None:
    saved = 0
    while True:
        await asyncio.sleep(SAVE_EVERY_S)
        try:
            saved = await _save(request, store, rid, saved)
        except sqlite3.Error as exc:
            log.warning("responses: saving %s's progress failed: %s", rid, exc)


async def _save(request: web.Request, store: AsyncStore, rid: str, saved: int) -> int:
    """Save the reply's ids so far when there are more than `saved`; how many there are."""
    marks = request.get(MARKS_KEY)
    if marks is None or len(marks.ids) == saved:
        return saved
    ids, segments = array.array("q", marks.ids), array.array("q", marks.segments)
    await store.run(store.store.progress, rid, int_blob(ids), int_blob(segments))
    return len(ids)


async def go_on(request: web.Request, store: AsyncStore, gen: Generation,
                keeper: Callable[..., Keep]) -> web.StreamResponse:
    """Finish a generation a restart cut off, store it, and answer it: whole, or (`?stream=true`)
    as a stream from its start, the delivered part first (the engine resends it), then the rest
    as it is made. One this supervisor is making now is answered as it stands: `in_progress`."""
    req: responses.ResponsesRequest = decode_json(_decoder, gen.request)
    shell = responses.Shell(req, gen.model, gen.id)
    shell.created_at = int(gen.created_at)
    if gen.id in request.app[LIVE]:
        return web.Response(body=msgspec.json.encode(shell.response("in_progress", [])),
                            content_type="application/json")
    stream = request.query.get("stream", "").lower() == "true"
    if "starting_after" in request.query:
        raise APIError(400, "starting_after is not supported for a response cut off by a restart: its stream "
                            "is sent again from the start.", param="starting_after")
    chat = msgspec.json.decode(gen.chat)
    chat["stream"] = stream
    if not stream:
        chat.pop("stream_options", None)
    if gen.tokens:
        chat["resume"] = {"tokens": gen.tokens, "segments": gen.segments, "resend": True}
    log.info("responses: %s was cut off after %d tokens; going on with it", gen.id, len(gen.tokens))
    body = msgspec.json.encode(chat)
    dialect = Responses(shell, keeper(store, shell, responses.input_items(req)))
    target = resolve_target(request, req.model, req.adapter)
    return await recorded(request, store, shell, None, body,
                          relay(request, target, body, dialect, stream=stream, started=time.perf_counter()))
