"""The handler's end of a job: events from the GPU thread, and a cancel flag for it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import AsyncIterator

from mlxd.protocol.events import Done, Event, Failed


class Ticket:
    """An event queue filled from the GPU thread, read by one request handler."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queued: deque[Event] = deque()
        # Set while events are queued: a handler can wait for one (with a timeout) and take
        # nothing, so a wait that times out cannot lose an event.
        self._has_events = asyncio.Event()
        self._cancelled = threading.Event()
        self.is_finished = False

    def emit(self, event: Event) -> None:
        """Called from the GPU thread: hand an event to the loop (dropped once the loop is gone)."""
        # A closed loop means the engine is exiting and nobody is listening.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._put, event)

    def cancel(self) -> None:
        """Ask the GPU thread to stop this job at its next step."""
        self._cancelled.set()

    def abort(self, event: Failed) -> None:
        """On the loop thread: end the handler's wait now with `event`, and cancel the job."""
        self.cancel()
        self._put(event)

    @property
    def is_cancelled(self) -> bool:
        return self._cancelled.is_set()

    async def wait_for_event(self, timeout: float) -> bool:
        """Whether an event is queued within `timeout` seconds; takes none (events() yields it)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._has_events.wait()
        return self._has_events.is_set()

    async def events(self) -> AsyncIterator[list[Event]]:
        """Yield batches of events (all that are queued) until Done or Failed."""
        while not self.is_finished:
            await self._has_events.wait()
            batch = self._take()
            for i, event in enumerate(batch):
                if isinstance(event, Done | Failed):
                    self.is_finished = True
                    del batch[i + 1 :]  # anything after the end (e.g. after an abort) is moot
                    break
            yield batch

    def _put(self, event: Event) -> None:
        self._queued.append(event)
        self._has_events.set()

    def _take(self) -> list[Event]:
        batch = list(self._queued)
        self._queued.clear()
        self._has_events.clear()
        return batch
