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
"""

from __future__ import annotations

import logging
import traceback

from mlxd.engine.gpu.device_memory import memory_line, release_unused
from mlxd.engine.spec import agreement

log = logging.getLogger("mlxd.engine")


def failed_step(exc: BaseException, what: str) -> None:
    """Log a step that raised (`what` it was; MLX's memory then); in an engine group, raise it on."""
    log.error("%s failed (MLX memory: %s):\n%s", what, memory_line(), traceback.format_exc())
    if agreement.grouped():
        log.error("engine group: a step failed on this rank, so the ranks are out of step; the group ends")
        raise exc


def after_failed_step(exc: BaseException) -> None:
    """Once the step's requests are failed: the memory it held goes back (device_memory.release_unused)."""
    log.info("after the failed step: %s", release_unused(exc))
