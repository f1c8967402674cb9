"""A generation request as the GPU thread sees it, and the handler's side of it (Ticket)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mlxd.protocol.events import Done, Event, Failed


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class Job:
    """Everything the GPU thread needs: prompt ids, limits, and where to send events."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: list[str]
    ticket: Ticket
    submitted_at: float = field(default_factory=time.perf_counter)


class Ticket:
    """The handler's end of a job: an event queue filled from the GPU thread, and a cancel flag."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()
        self.is_finished = False

    def emit(self, event: Event) -> None:
        """Called from the GPU thread: hand an event to the loop."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def cancel(self) -> None:
        """Ask the GPU thread to stop this job at its next step."""
        self._cancelled.set()

    @property
    def is_cancelled(self) -> bool:
        return self._cancelled.is_set()

    async def events(self) -> AsyncIterator[list[Event]]:
        """Yield batches of events (all that are queued) until Done or Failed."""
        while not self.is_finished:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            self.is_finished = isinstance(batch[-1], Done | Failed)
            yield batch
