"""A request's way to its engine: queue for a slot, forward, and try again where nothing ran.

A streaming request that waits long for its engine gets SSE comments meanwhile (waiting.py);
its errors then come as the dialect's error events, since the 200 has gone out. An engine
that turned the request away before starting it (draining, leased) or died before taking it
puts the request back in the queue, a bounded number of times; one whose socket refused it
(dead, or dying: its process not yet exited) is waited out first (Engine.lost).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aiohttp import web

from mlxd.protocol.errors import APIError
from mlxd.protocol.process import ADAPTER_HEADER, LEASE_HEADER, PRIORITY_HEADER, RESUME_HEADER
from mlxd.supervisor.adapters import AdapterEntry, header_value
from mlxd.supervisor.engines.engine import Engine
from mlxd.supervisor.engines.pool import Pool
from mlxd.supervisor.engines.upstream import (
    EngineBusy,
    EngineUnreachable,
    crashed_error,
    out_of_memory_error,
)
from mlxd.supervisor.registry import ModelEntry
from mlxd.supervisor.relay.dialect import Dialect
from mlxd.supervisor.relay.forward import forward
from mlxd.supervisor.relay.keys import (
    DIALECT_KEY,
    FIRST_CHUNK_KEY,
    MARKS_KEY,
    MODEL_KEY,
    RESUMES_KEY,
)
from mlxd.supervisor.relay.resume import Cut, ReplyMarks
from mlxd.supervisor.relay.waiting import WaitingStream

log = logging.getLogger("mlxd.supervisor")
MAX_REQUEUES = 5
UNREACHABLE_PAUSE_S = 0.05


async def serve(
    request: web.Request, pool: Pool, entry: ModelEntry, body: bytes, dialect: Dialect, *, stream: bool,
    keepalive_s: float, on_first_chunk: Callable[[float], None] = lambda at: None, priority: int | None = None,
    key_priority: int | None = None, adapters: tuple[AdapterEntry, ...] = (),
) -> web.StreamResponse:
    """Queue for `entry`'s engine and relay `body` to it, answering in `dialect`.
    `on_first_chunk` hears when the first streamed event went out (perf_counter()).
    `key_priority` is the caller's key's default, sent to the engine for a body that sets none;
    the pool's queue orders by `priority` (the body's), else by it. The request runs under
    `adapters` (mounted on the engine first)."""
    request[MODEL_KEY], request[DIALECT_KEY] = entry.id, dialect
    engine = pool.slot_for(entry).engine
    waiting = WaitingStream(request, keepalive_s, dialect, engine.load_progress) if stream else None

    def first_chunk() -> None:
        if FIRST_CHUNK_KEY in request:
            return  # a reply going on after a cut: its first chunk went out before
        request[FIRST_CHUNK_KEY] = time.perf_counter()
        on_first_chunk(request[FIRST_CHUNK_KEY])

    marks = ReplyMarks() if resumes(request, pool, entry) else None
    if marks is not None and stream:
        request[MARKS_KEY] = marks  # for a stored Responses generation's progress (responses_routes.py)
    try:
        queued = priority if priority is not None else key_priority if key_priority is not None else 0
        return await _route(request, pool, entry, body, dialect, waiting, first_chunk, queued, key_priority, adapters,
                            marks)
    except APIError as err:
        if waiting is None or waiting.response is None:
            raise
        return await waiting.fail(err)
    except ConnectionResetError:
        if waiting is None or waiting.response is None:
            raise
        return waiting.response  # the caller left while it waited: nothing more to say


async def _route(
    request: web.Request, pool: Pool, entry: ModelEntry, body: bytes, dialect: Dialect,
    waiting: WaitingStream | None, on_first_chunk: Callable[[], None], queued: int, key_priority: int | None,
    adapters: tuple[AdapterEntry, ...], marks: ReplyMarks | None,
) -> web.StreamResponse:
    lease_id = request.headers.get(LEASE_HEADER)
    pause_s, num_resent, requeues, sent = 0.0, 0, 0, body
    refused: tuple[Engine, int | None] | None = None  # the engine run that refused it last
    while requeues < MAX_REQUEUES:
        await asyncio.sleep(pause_s)  # after an unreachable engine: its owner sees the exit meanwhile
        if refused is not None:
            lost = refused[0].lost(refused[1])  # its slot was let go (finally): a restart may begin
            await (waiting.wait(lost, lambda _: None) if waiting is not None else lost)
            refused = None
        acquire = pool.acquire(entry, lease_id, priority=queued)
        try:
            slot = await (waiting.wait(acquire, pool.release) if waiting is not None else acquire)
        except APIError as err:
            if not restarts_again(marks, err, pool.config.resume_attempts):
                raise
            log.info("%s %s: the engine it was going on on failed to start; trying again", request.method,
                     request.path)
            pause_s = UNREACHABLE_PAUSE_S
            continue
        pid = slot.engine.pid
        try:
            headers = {LEASE_HEADER: slot.engine_lease_token} if lease_id and slot.engine_lease_token else {}
            if key_priority is not None:
                headers[PRIORITY_HEADER] = str(key_priority)
            await pool.adapters.ensure(slot, adapters)
            headers[ADAPTER_HEADER] = header_value(adapters)
            headers.update(dialect.engine_headers)
            prepared = waiting.response if waiting is not None else None
            resp = await forward(request, slot.engine.socket, slot.engine.connections, sent, headers, dialect,
                                 on_first_chunk=on_first_chunk, prepared=prepared, marks=marks)
        except Cut as cut:
            assert marks is not None
            if waiting is not None and cut.response is not None:
                waiting.response = cut.response  # the caller's stream goes on (or ends) in this response
            request[RESUMES_KEY] = marks
            if marks.cuts >= pool.config.resume_attempts or not marks.resumable():
                log.warning("%s %s: cut short %d times (the last: %s); ending it", request.method, request.path,
                            marks.cuts + 1, "out of device memory" if marks.out_of_memory else "its engine went away")
                marks.gave_up = True
                pool.count_resume(entry.id, went_on=False)
                raise (out_of_memory_error() if marks.out_of_memory else crashed_error()) from None
            marks.cut()
            pool.count_resume(entry.id, went_on=True)
            sent, pause_s = marks.continuation(body), UNREACHABLE_PAUSE_S
            log.info("%s %s: its engine went away after %d tokens; going on on the next (%d of %d)", request.method,
                     request.path, len(marks.ids), marks.cuts, pool.config.resume_attempts)
            continue
        except EngineUnreachable as dead:
            if dead.was_sent and num_resent:
                raise crashed_error() from None
            num_resent += dead.was_sent
            pause_s, requeues, refused = UNREACHABLE_PAUSE_S, requeues + 1, (slot.engine, pid)
            continue  # it died before it took the request: wait for its exit, then in the queue for its restart
        except EngineBusy:
            requeues += 1
            continue  # raced a drain or lease at the engine: wait in the queue again
        finally:
            pool.release(slot)
        if marks is not None:
            marks.went_on()  # a whole answer worked out again (a stream's went on at its first mark)
        if waiting is not None and waiting.response is not None and isinstance(resp, web.Response):
            data = resp.body if isinstance(resp.body, bytes) else b"{}"
            raise dialect.engine_error(resp.status, data)  # an error, after the SSE head went out
        return resp
    raise APIError(503, f"Model {entry.id} stayed busy or unreachable; try again.", type="server_error",
                   code="engine_busy", headers={"Retry-After": "1"})


def restarts_again(marks: ReplyMarks | None, err: APIError, attempts: int) -> bool:
    """Whether a request going on after a cut waits for another start of its model when the one
    it waited for failed (an engine killed while it loaded): once more of its attempts, while
    the pool tries the model again (a model that cannot load is `model_failed` next, not this)."""
    if marks is None or not marks.cuts or err.code != "model_load_failed" or marks.cuts >= attempts:
        return False
    marks.cuts += 1
    return True


OFF = frozenset({"off", "0", "false", "no"})


def resumes(request: web.Request, pool: Pool, entry: ModelEntry) -> bool:
    """Whether a reply cut by its engine's death goes on on the next: the model's `resume`
    (else the pool's), unless the caller opted out (process.RESUME_HEADER)."""
    if request.headers.get(RESUME_HEADER, "").strip().lower() in OFF:
        return False
    return entry.resume if entry.resume is not None else pool.config.resume
