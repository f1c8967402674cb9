"""An engine told to stop again while it stops: a dying parent with threads sends the
parent-death SIGTERM once per reparenting (to each of its threads, then to init), so a repeat
may land at any point of the engine's exit."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from tests.support import EngineProcess


def test_sigterm_again_and_again_while_it_stops_leaves_no_socket(tiny_model: Path) -> None:
    # A repeat that came after the event loop had closed (SIGTERM's default action again) used
    # to kill the engine before it removed its socket: 7 of 8 exits here left it behind.
    for _ in range(3):
        engine = EngineProcess(tiny_model, "tiny").wait_ready()
        try:
            engine.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while engine.proc.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(engine.proc.pid, signal.SIGTERM)
                time.sleep(0.0002)
            assert engine.proc.poll() is not None, "the engine did not exit"
            assert not engine.socket.exists(), f"exit {engine.proc.returncode} left the socket behind"
        finally:
            engine.stop()
