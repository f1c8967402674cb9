"""The service's own routes: liveness and Prometheus metrics."""

from __future__ import annotations

import asyncio

from aiohttp import web

from mlxd import __version__
from mlxd.protocol.supervisor_api import Health
from mlxd.supervisor.http.answers import json_answer
from mlxd.supervisor.http.keys import METRICS, POOL


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text format (engines' prompt-cache figures fetched first)."""
    await asyncio.gather(*(engine.fetch_stats() for engine in request.app[POOL].engines()))
    return web.Response(body=request.app[METRICS].get().render(), content_type="text/plain", charset="utf-8")


async def health(request: web.Request) -> web.Response:
    """GET /health (no auth): the supervisor is up."""
    engines = {e.model_id: e.state for e in request.app[POOL].engines()}
    return json_answer(Health("ok", __version__, engines))


def setup_service_routes(app: web.Application) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
