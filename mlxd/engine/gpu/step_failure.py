"""What a lane's step that raised ends: its requests alone, or in an engine group the engine.

In one engine a step that raised fails the requests in it (`generation_failed`) and the engine
serves on. In a group every rank runs the same step and sums across the others, so a step that
raised on one rank (a peer gone mid-collective: `[ring] connection to a peer was lost`, or
anything else) leaves the ranks out of step. The group ends then (its watch thread sees a rank
gone), and the supervisor starts it again and goes on with its replies (docs/resume.md). Had
the lane answered them `generation_failed` first, a client would get that error in the race.
So in a group the failure is raised on: the GPU thread ends, its requests end as `engine_failed`,
which the supervisor takes as the engine's end, and the reply goes on on the next. The same
holds for the GPU work done for one request outside a step (starting, pausing, moving it into
the batch, a shared prompt's prefill): alone only that request fails; in a group the engine ends.

A lost device ends the engine too, grouped or not: CUDA's sticky errors (an illegal memory
access, a kernel that faulted or trapped) leave the process's context unusable, so every later
operation fails as well (an H100 once answered each request after one with `generation failed:
cudaMallocManaged failed: an illegal memory access was encountered` in 60 ms). Metal's failed
command buffer (a GPU hang or fault) leaves no better state. Raised on, the engine ends, the
supervisor starts a fresh one and its replies go on there instead of failing.
"""

from __future__ import annotations

import logging
import traceback

from mlxd.engine.gpu.device_memory import memory_line, release_unused
from mlxd.engine.spec import agreement

log = logging.getLogger("mlxd.engine")


# What MLX's errors say when the device's state is lost (CUDA's sticky errors, Metal's failed
# command buffer): nothing run on it afterwards in this process can be trusted.
DEVICE_LOST = (
    "an illegal memory access was encountered", "unspecified launch failure", "misaligned address",
    "device-side assert triggered", "an illegal instruction was encountered", "hardware stack error",
    "invalid program counter", "uncorrectable ECC error", "the launch timed out and was terminated",
    "Command buffer execution failed",
)


# What they say when the device's memory ran out (CUDA's allocator, MLX's Metal allocator): the
# step failed for want of room, not for its requests; the memory is given back after it. (A
# Metal command buffer that failed for want of memory is a lost device: DEVICE_LOST.)
OUT_OF_MEMORY = ("out of memory", "[metal::malloc]")
OUT_OF_MEMORY_CODE = "engine_out_of_memory"  # a reply it cut short: the supervisor goes on with it (resume.py)


def failed_code(exc: BaseException) -> str:
    """The error code of the requests a failed step ends: OUT_OF_MEMORY_CODE where memory ran out
    (a stream the supervisor marks goes on, on this engine once the step's memory is back),
    else `generation_failed`."""
    text = str(exc)
    return OUT_OF_MEMORY_CODE if any(words in text for words in OUT_OF_MEMORY) else "generation_failed"


def device_lost(exc: BaseException) -> bool:
    """Whether `exc` says the device's state is lost for this process (DEVICE_LOST)."""
    text = str(exc)
    return any(words in text for words in DEVICE_LOST)


def failed_step(exc: BaseException, what: str) -> None:
    """Log a step that raised (`what` it was; MLX's memory then); raise it on where the engine
    must end: in an engine group, or where the device is lost."""
    lost = device_lost(exc)
    log.error("%s failed (MLX memory: %s):\n%s", what, "not read: the device is lost" if lost else memory_line(),
              traceback.format_exc())
    if agreement.grouped():
        log.error("engine group: a step failed on this rank, so the ranks are out of step; the group ends")
        raise exc
    if lost:
        log.critical("the device's state is lost (%s); the engine ends, and its replies go on on the next", exc)
        raise exc


def after_failed_step(exc: BaseException) -> None:
    """Once the step's requests are failed: the memory it held goes back (device_memory.release_unused)."""
    log.info("after the failed step: %s", release_unused(exc))


def failed_row(exc: BaseException) -> None:
    """Log one row's failure outside the step (its tokens' handling); raise it on where the
    device is lost (the engine ends)."""
    if device_lost(exc):
        failed_step(exc, "reading a row's tokens")
    log.error("generation failed for one row:\n%s", traceback.format_exc())
