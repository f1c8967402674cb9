"""Make the engine exit soon after its parent dies, however the parent died."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable

POLL_S = 0.5
PR_SET_PDEATHSIG = 1


def set_death_signal() -> None:
    """On Linux, ask the kernel to SIGTERM us when the parent thread exits.

    The kernel sends it on every reparenting: to another thread of a multi-threaded parent,
    then to init or a subreaper. So a parent's death may come as several SIGTERMs.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


async def watch_parent(parent_pid: int, on_gone: Callable[[], None]) -> None:
    """Poll the parent pid (portable: macOS has no PDEATHSIG); call on_gone once it changes."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(POLL_S)
    on_gone()
