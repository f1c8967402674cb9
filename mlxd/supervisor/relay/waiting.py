"""A streaming request that waits for its engine says so: SSE comments until the answer starts.

A stream queued behind a swap, a lease or other requests would otherwise get nothing for as
long as it waits, and a client with a read timeout (10 s is common) gives up. Once it has
waited `keepalive_s`, the caller gets the SSE head and a comment line (`: waiting`) every
`keepalive_s`; SSE clients ignore comments. While the model loads, the comment says how far
it has got (`: waiting for the model: reading weights 45%`), for a person watching `curl -N`.
From then on every error, the pool's or the engine's, reaches it as an SSE error event, since
the 200 has been sent: the request's dialect makes them (a Responses stream's are its
`error` and `response.failed` events, an Anthropic one's its `error` event).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web

from mlxd.protocol.errors import APIError
from mlxd.protocol.stats import LoadProgress, phase_words
from mlxd.supervisor.relay.dialect import Dialect

T = TypeVar("T")
COMMENT = b": waiting for the model\n\n"


class WaitingStream:
    """One streaming request's caller while it waits: the SSE head and comments, once needed."""

    def __init__(self, request: web.Request, keepalive_s: float, dialect: Dialect,
                 progress: Callable[[], LoadProgress | None] = lambda: None) -> None:
        self._request = request
        self._dialect = dialect
        self._progress = progress  # the model's load progress, while it starts
        self._keepalive_s = keepalive_s
        self.response: web.StreamResponse | None = None  # prepared once the wait got long

    async def wait(self, step: Awaitable[T], abandon: Callable[[T], None]) -> T:
        """`step`'s result, with a comment to the caller every `keepalive_s` until it is ready.

        If the caller leaves (or a comment cannot be written) after `step` succeeded, its
        result goes to `abandon` (a slot to give back), since nobody else will use it.
        """
        task = asyncio.ensure_future(step)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self._keepalive_s)
                if done:
                    return task.result()
                await self._ping()
        except BaseException:
            if task.done() and not task.cancelled() and task.exception() is None:
                abandon(task.result())
            else:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            raise

    async def _ping(self) -> None:
        if self.response is None:
            self.response = web.StreamResponse(headers=self._dialect.stream_headers)
            await self.response.prepare(self._request)
        if note := self._dialect.comment(comment(self._progress())):
            await self.response.write(note)

    async def fail(self, err: APIError) -> web.StreamResponse:
        """End the started stream with `err` as an SSE error event, in the caller's API."""
        assert self.response is not None
        with contextlib.suppress(ConnectionResetError):
            await self.response.write(self._dialect.error_event(err))
            await self.response.write_eof()
        return self.response


def comment(load: LoadProgress | None) -> bytes:
    """The waiting comment; with the model's load progress while it starts."""
    if load is None:
        return COMMENT
    text = phase_words(load.phase, load.done, load.total)
    return f": waiting for the model: {text} ({load.elapsed_s:.0f} s)\n\n".encode()
