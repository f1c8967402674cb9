"""Which event loop a process runs: uvloop where installed, for the supervisor and the engines.

In the supervisor uvloop costs about a fifth less CPU per relayed token. In an engine its
reading of a request body in C matters most for images: eight requests with 3.2 MB bodies
at once were read by the standard loop's Python transport one after another
(benchmarks/vision.py; the numbers are in docs/benchmarks.md). `MLXD_EVENT_LOOP=asyncio`
opts both out.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping

log = logging.getLogger("mlxd")


def loop_factory(env: Mapping[str, str] = os.environ) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's new_event_loop where installed; None (the standard loop) for MLXD_EVENT_LOOP=asyncio."""
    choice = env.get("MLXD_EVENT_LOOP", "uvloop")
    if choice not in ("uvloop", "asyncio"):
        log.warning("MLXD_EVENT_LOOP=%r: expected uvloop or asyncio; using asyncio", choice)
        return None
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """'uvloop' or 'asyncio', for the log."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
