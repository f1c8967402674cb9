"""The handler's end of a job: events from the GPU thread, and a cancel flag for it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

from mlxd.protocol.events import Done, Event, Failed


class Ticket:
    """An event queue filled from the GPU thread, read by one request handler."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()
        self.is_finished = False

    def emit(self, event: Event) -> None:
        """Called from the GPU thread: hand an event to the loop (dropped once the loop is gone)."""
        # A closed loop means the engine is exiting and nobody is listening.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def cancel(self) -> None:
        """Ask the GPU thread to stop this job at its next step."""
        self._cancelled.set()

    def abort(self, event: Failed) -> None:
        """On the loop thread: end the handler's wait now with `event`, and cancel the job."""
        self.cancel()
        self._queue.put_nowait(event)

    @property
    def is_cancelled(self) -> bool:
        return self._cancelled.is_set()

    async def events(self) -> AsyncIterator[list[Event]]:
        """Yield batches of events (all that are queued) until Done or Failed."""
        while not self.is_finished:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            for i, event in enumerate(batch):
                if isinstance(event, Done | Failed):
                    self.is_finished = True
                    del batch[i + 1 :]  # anything after the end (e.g. after an abort) is moot
                    break
            yield batch
