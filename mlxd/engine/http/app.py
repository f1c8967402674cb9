"""The engine's aiohttp app: routes, error middleware, and the GPU gateway's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import mlx.core as mx
import msgspec
import psutil
from aiohttp import web

from mlxd.engine.cache.prefix_cache import FlushReport
from mlxd.engine.embed import routes as embed_routes
from mlxd.engine.gpu.cuda_memory import cuda_memory
from mlxd.engine.gpu.device_memory import device_kind
from mlxd.engine.gpu.gateway import Gateway
from mlxd.engine.gpu.stats import Stats
from mlxd.engine.http import curve_routes
from mlxd.engine.http import openai_requests as oa_requests
from mlxd.engine.http import openai_routes as routes
from mlxd.engine.http.adapter_routes import setup_adapter_routes
from mlxd.engine.http.admission import Admission
from mlxd.engine.http.keys import ADMISSION, GATEWAY, SETTINGS, STATS
from mlxd.engine.settings import EngineSettings
from mlxd.http_errors import make_error_middleware
from mlxd.protocol import openai as oa
from mlxd.protocol.process import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    DRAIN_PATH,
    EMBEDDINGS_PATH,
    GENERATE_PATH,
    HEALTH_PATH,
    LEASE_PATH,
    MODELS_PATH,
    RENDER_PATH,
    SIGNAL_PATH,
    STATS_PATH,
    DrainRequest,
    LeaseLine,
    LeaseRequest,
)
from mlxd.protocol.stats import (
    EngineHealth,
    EngineStats,
    HealthStatus,
    LastRequest,
    MemoryStats,
    RequestCounts,
    TokenCounts,
)

# A lease holder that vanished is noticed at the next heartbeat write, if not sooner.
LEASE_HEARTBEAT_S = 1.0
# A drain's cache writes are given its timeout; the answer waits this much longer at most.
FLUSH_SLACK_S = 5.0


def make_app(settings: EngineSettings, gateway: Gateway, stats: Stats) -> web.Application:
    """The engine app; its cleanup context owns the GPU thread."""
    app = web.Application(client_max_size=settings.max_body, middlewares=[make_error_middleware("engine")])
    app[SETTINGS], app[GATEWAY], app[STATS] = settings, gateway, stats
    app[ADMISSION] = Admission(gateway.abort_open, stats, lambda timeout_s: _flush(gateway, timeout_s))
    app.router.add_post(CHAT_PATH, routes.chat_completions)
    app.router.add_post(COMPLETIONS_PATH, routes.completions)
    app.router.add_post(RENDER_PATH, routes.render)
    app.router.add_post(EMBEDDINGS_PATH, embed_routes.embeddings)
    app.router.add_post(SIGNAL_PATH, curve_routes.signal)
    app.router.add_post(GENERATE_PATH, curve_routes.generate)
    app.router.add_get(MODELS_PATH, list_models)
    app.router.add_get(HEALTH_PATH, health)
    app.router.add_get(STATS_PATH, admin_stats)
    app.router.add_post(DRAIN_PATH, admin_drain)
    app.router.add_post(LEASE_PATH, admin_lease)
    setup_adapter_routes(app)
    app.cleanup_ctx.append(gateway_ctx)
    return app


async def _flush(gateway: Gateway, timeout_s: float) -> FlushReport:
    """The prompt cache's RAM entries written to SSD (on the GPU thread): its report. The GPU
    thread may first finish a prefill chunk, and may have died: the wait is bounded."""
    future = gateway.flush_cache(timeout_s)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s + FLUSH_SLACK_S)
    except TimeoutError:
        return FlushReport(ms=round((timeout_s + FLUSH_SLACK_S) * 1000, 3), complete=False)


async def gateway_ctx(app: web.Application) -> AsyncIterator[None]:
    """The GPU thread lives as long as the app: started at setup, stopped at cleanup."""
    app[GATEWAY].start()
    yield
    app[GATEWAY].stop()  # no join: the process exits with os._exit, even mid-prefill


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: the one model this engine serves."""
    settings, stats = request.app[SETTINGS], request.app[STATS]
    card = oa.ModelCard(id=settings.model_id, created=int(stats.started_at))
    return oa_requests.json_response(oa.ModelList(data=[card]))


async def health(request: web.Request) -> web.Response:
    """GET /health: `loading` until the model is loaded, then `ready`; `draining` during (and after) a drain."""
    gateway = request.app[GATEWAY]
    status: HealthStatus = "ready" if gateway.is_loaded else "failed" if gateway.load_error else "loading"
    if status != "failed" and request.app[ADMISSION].is_draining:
        status = "draining"
    load = gateway.meter.snapshot() if status == "loading" else None
    return oa_requests.json_response(EngineHealth(status, request.app[SETTINGS].model_id, load), 503 if status == "failed" else 200)


async def admin_stats(request: web.Request) -> web.Response:
    """GET /admin/stats: counters, memory in use and uptime."""
    s, settings = request.app[STATS], request.app[SETTINGS]
    gateway = request.app[GATEWAY]
    body = EngineStats(
        model=settings.model_id,
        status="ready" if gateway.is_loaded else "failed" if gateway.load_error else "loading",
        uptime_s=round(time.time() - s.started_at, 3),
        busy_s=round(s.busy_s, 6),
        context_window=gateway.context_window,
        requests=RequestCounts(s.num_requests, s.num_active, s.num_completed, s.num_cancelled, s.num_failed,
                               s.num_continued),
        admission=request.app[ADMISSION].snapshot(),
        lanes=gateway.snapshot(),
        tokens=TokenCounts(s.prompt_tokens, s.cached_tokens, s.completion_tokens, s.continued_tokens),
        prompt_cache=gateway.prompt_cache.snapshot() if gateway.prompt_cache is not None else None,
        last=LastRequest(s.last_finish_reason, s.last_completion_tokens, dict(s.last_timings_ms)),
        memory=MemoryStats(psutil.Process().memory_info().rss, mx.get_active_memory(), mx.get_peak_memory(),
                           mx.get_cache_memory(), cuda_memory() if gateway.is_loaded and device_kind() == "cuda" else None),
    )
    return oa_requests.json_response(body)


async def admin_drain(request: web.Request) -> web.Response:
    """POST /admin/drain: refuse new requests, let those in flight finish (abort them at the timeout)."""
    req = await oa_requests.decode_body(request, DrainRequest, DrainRequest())
    result = await request.app[ADMISSION].drain(req.timeout_s, req.resume)
    return oa_requests.json_response(result)


async def admin_lease(request: web.Request) -> web.StreamResponse:
    """POST /admin/lease: hold the exclusive lease while this NDJSON stream stays open."""
    req = await oa_requests.decode_body(request, LeaseRequest, LeaseRequest())
    async with request.app[ADMISSION].lease(req.holder, req.wait_s) as token:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(_ndjson(LeaseLine("held", token, req.holder)))
        # Ends when the holder disconnects: aiohttp cancels this handler, or a write fails.
        with contextlib.suppress(ConnectionResetError):
            while True:
                await asyncio.sleep(LEASE_HEARTBEAT_S)
                await resp.write(HEARTBEAT)
    return resp


def _ndjson(line: LeaseLine) -> bytes:
    return msgspec.json.encode(line) + b"\n"


HEARTBEAT = _ndjson(LeaseLine("held"))
