"""GET /library: every model on disk, whether it fits this machine, and its decode speed,
predicted and measured (supervisor/library.py gathers it; protocol/fit.py is the arithmetic)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from mlxd.protocol import fit
from mlxd.protocol.errors import APIError
from mlxd.supervisor.http.answers import json_answer
from mlxd.supervisor.http.keys import LIBRARY, POOL, REGISTRY, TIMELINE
from mlxd.supervisor.library import machine, model_row

WAIT_S = 60.0  # the first call waits this long at most for the bandwidth probe (`?wait_s=` to change)


async def library(request: web.Request) -> web.Response:
    """GET /library (`?wait_s=0`: do not wait for a first bandwidth measurement)."""
    try:
        wait_s = float(request.query.get("wait_s", WAIT_S))
    except ValueError:
        raise APIError(400, "wait_s must be a number of seconds.", param="wait_s") from None
    if not 0 <= wait_s <= 600:
        raise APIError(400, "wait_s must be between 0 and 600.", param="wait_s")
    registry, pool, timeline, bandwidth = request.app[REGISTRY], request.app[POOL], request.app[TIMELINE], request.app[LIBRARY]
    registry.refresh()
    found = await bandwidth.get(wait_s)
    rate = float(found["bandwidth_bytes_s"]) if found and found.get("bandwidth_bytes_s") else None
    overhead = float(found.get("layer_overhead_s") or 0.0) if found else 0.0
    budget = pool.limits.budget_bytes
    states = {e.model_id: str(e.state) for e in pool.engines()}
    entries = [e for e in registry.entries() if e.is_available]
    rows = await asyncio.gather(*(asyncio.to_thread(model_row, e, states.get(e.id, "stopped"), budget,
                                                    pool.memory_estimate(e), pool.prompt_cache_bytes, rate,
                                                    timeline.decode_rate(e.id), overhead) for e in entries))
    return json_answer(fit.Library(machine=machine(pool.device, pool.models_memory_bytes, budget, found,
                                                               bandwidth.note), models=list(rows)))


def setup_library_routes(app: web.Application) -> None:
    app.router.add_get("/library", library)
