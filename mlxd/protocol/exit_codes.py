"""Named engine exit codes: the supervisor reads them to tell a crash from a bad model."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    # Bad arguments, an unsafe socket dir, a socket already served: retrying won't help.
    ENGINE_BOOT_ERROR = 3
    # The model dir is missing, malformed, unsupported, or does not fit: retrying won't help.
    MODEL_LOAD_ERROR = 4
    # The parent (supervisor) went away; the engine shut itself down.
    PARENT_GONE = 5
    # The GPU thread ended unexpectedly; the engine cannot serve (treat as a crash).
    GPU_THREAD_DIED = 6
