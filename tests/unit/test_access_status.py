"""The status a streamed request is counted and logged with when its caller's connection closes:
a caller that had the whole stream was answered (200), one that left before its end went away
(499), whether aiohttp cancelled the handler (`handler_cancellation`) or the handler returned.
The cancellation's timing is the part a real client cannot cause on cue, so these handlers
act it out on the real middleware, metrics and ReplyMarks."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from mlxd.protocol.process import MARK, REPLY_HEADER
from mlxd.supervisor.config import PoolConfig
from mlxd.supervisor.engines.pool import Pool
from mlxd.supervisor.http.metrics import LazyMetrics, make_metrics_middleware
from mlxd.supervisor.http.timeline import Timeline
from mlxd.supervisor.relay.keys import MARKS_KEY
from mlxd.supervisor.relay.resume import DONE, ReplyMarks

FIRST = b'data: {"choices": []}\n\n' + MARK + b"0 2 5,6\n\n"


async def streamed(request: web.Request, payloads: list[bytes]) -> tuple[web.StreamResponse, ReplyMarks]:
    """A stream relayed as the relay does: each payload through the reply's marks, then written."""
    marks = ReplyMarks()
    request[MARKS_KEY] = marks
    resp = web.StreamResponse()
    await resp.prepare(request)
    for payload in payloads:
        await resp.write(marks.take(payload))
    return resp, marks


async def cancelled_after_done(request: web.Request) -> web.StreamResponse:
    await streamed(request, [FIRST, DONE])
    raise asyncio.CancelledError  # the caller reset the connection while the handler wound down


async def cancelled_mid_stream(request: web.Request) -> web.StreamResponse:
    await streamed(request, [FIRST])
    raise asyncio.CancelledError


async def returned_after_the_caller_left(request: web.Request) -> web.StreamResponse:
    resp, _ = await streamed(request, [FIRST])
    assert request.transport is not None
    request.transport.close()  # what a caller's reset leaves: the relay sees it closing and returns
    return resp


async def returned_whole(request: web.Request) -> web.StreamResponse:
    resp, _ = await streamed(request, [FIRST, DONE])
    await resp.write_eof()
    return resp


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def counted_status(tmp_path: Path, handler: Handler) -> list[str]:
    """Call `handler` behind the metrics middleware once: the statuses counted for it."""
    lazy = LazyMetrics(Pool(tmp_path, config=PoolConfig(spare_engine=False)))

    async def run() -> None:
        app = web.Application(middlewares=[make_metrics_middleware(lazy, Timeline())])
        app.router.add_post("/v1/chat/completions", handler)
        async with TestClient(TestServer(app)) as client:
            try:
                resp = await client.post("/v1/chat/completions", json={})
                await resp.read()
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
                pass  # the handler's end closed the connection mid-answer
            await asyncio.sleep(0.05)

    asyncio.run(run())
    return [sample.labels["status"] for metric in lazy.get().requests.collect() for sample in metric.samples
            if sample.name == "mlxd_requests_total" and sample.value > 0]


@pytest.mark.parametrize(("handler", "status"), [
    (cancelled_after_done, "200"),
    (cancelled_mid_stream, "499"),
    (returned_after_the_caller_left, "499"),
    (returned_whole, "200"),
])
def test_a_stream_is_counted_answered_only_if_its_caller_had_all_of_it(tmp_path: Path, handler: Handler,
                                                                       status: str) -> None:
    assert counted_status(tmp_path, handler) == [status]


def test_metrics_count_every_cut_as_the_pool_does_though_back_to_back_cuts_are_one_wait(tmp_path: Path) -> None:
    pool = Pool(tmp_path, config=PoolConfig(spare_engine=False))
    metrics = LazyMetrics(pool).get()
    marks = ReplyMarks()
    marks.head({REPLY_HEADER.lower(): "chatcmpl-1 1700000000"})
    marks.take(b'data: {"x": 1}\n\n: ids 0 1 7\n\n')
    for _ in range(2):  # as serve.py does at each cut that goes on
        marks.cut()
        pool.count_resume("tiny", went_on=True)
    marks.take(b'data: {"x": 2}\n\n: ids 0 2 8\n\n')
    metrics.count_resumes("tiny", marks)
    went_on = metrics.registry.get_sample_value("mlxd_resumes_total", {"model": "tiny", "outcome": "went_on"})
    assert went_on == pool.resumes["tiny"][0] == 2
    assert metrics.registry.get_sample_value("mlxd_resume_seconds_count", {"model": "tiny"}) == 1  # one wait
