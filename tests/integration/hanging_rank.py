"""The real engine, as a rank of a group that hangs on cue: SIGUSR1 blocks its main thread (a
follower's GPU loop) for good, while its other threads, the heartbeat's among them, go on, as
in a rank stuck on its GPU. Run as a script with MLXD_BLAS=off (the OpenBLAS re-exec would
drop the handler)."""

from __future__ import annotations

import signal
import threading

from mlxd.engine.__main__ import main

signal.signal(signal.SIGUSR1, lambda *_: threading.Event().wait())
main()
