"""An engine told to stop again while it stops: a dying parent with threads sends the
parent-death SIGTERM once per reparenting (to each of its threads, then to init), so a repeat
may land at any point of the engine's exit."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
from pathlib import Path

from tests.support import EngineProcess, wait_for


def sigterm_again(proc: subprocess.Popen[bytes]) -> bool:
    """Another SIGTERM, unless it has exited (reaped after the signal: the pid is never reused under it)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    return proc.poll() is not None


def test_sigterm_again_and_again_while_it_stops_leaves_no_socket(tiny_model: Path) -> None:
    # A repeat that came after the event loop had closed (SIGTERM's default action again) used
    # to kill the engine before it removed its socket: 7 of 8 exits here left it behind.
    for _ in range(3):
        engine = EngineProcess(tiny_model, "tiny")
        try:
            engine.wait_ready()
            engine.proc.send_signal(signal.SIGTERM)
            assert wait_for(functools.partial(sigterm_again, engine.proc), 30, interval=0.0002), "the engine did not exit"
            assert not engine.socket.exists(), f"exit {engine.proc.returncode} left the socket behind"
        finally:
            engine.stop()
