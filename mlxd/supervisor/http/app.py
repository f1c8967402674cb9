"""The supervisor's aiohttp app: auth, routes, and the engines' lifetime."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from mlxd.http_errors import Handler, make_error_middleware
from mlxd.hub.removal import OwnedModels
from mlxd.protocol.errors import APIError
from mlxd.protocol.jobs import DATASET_KEY_ENV, Job, Made
from mlxd.supervisor.adapters import AdapterCatalog
from mlxd.supervisor.config import Config
from mlxd.supervisor.engines.leases import Leases
from mlxd.supervisor.engines.pool import Pool
from mlxd.supervisor.http.adapter_routes import is_admin_route, setup_adapter_routes
from mlxd.supervisor.http.admin_routes import setup_admin_routes
from mlxd.supervisor.http.anthropic_routes import setup_anthropic_routes
from mlxd.supervisor.http.auth import Auth
from mlxd.supervisor.http.connections import make_body_middleware
from mlxd.supervisor.http.guard import (
    HostPolicy,
    add_cors_headers,
    machine_names,
    make_guard_middleware,
)
from mlxd.supervisor.http.image_fetch import ImageFetcher
from mlxd.supervisor.http.keys import (
    ADAPTERS,
    AUTH,
    CONFIG,
    IMAGES,
    JOBS,
    LAB_FILES,
    LEASES,
    LIBRARY,
    METRICS,
    OWNED,
    POOL,
    REGISTRY,
    TIMELINE,
)
from mlxd.supervisor.http.lab_data_routes import setup_lab_data_routes
from mlxd.supervisor.http.lab_routes import is_lab_route, setup_lab_routes
from mlxd.supervisor.http.library_routes import setup_library_routes
from mlxd.supervisor.http.metrics import LazyMetrics, make_metrics_middleware
from mlxd.supervisor.http.ollama_models import setup_ollama_model_routes
from mlxd.supervisor.http.ollama_routes import setup_ollama_routes
from mlxd.supervisor.http.openai_routes import setup_openai_routes
from mlxd.supervisor.http.openapi import openapi_json
from mlxd.supervisor.http.responses_routes import setup_responses_routes
from mlxd.supervisor.http.service_routes import setup_service_routes
from mlxd.supervisor.http.timeline import Timeline
from mlxd.supervisor.http.web_routes import setup_web_routes
from mlxd.supervisor.jobs.runner import JobRunner
from mlxd.supervisor.jobs.store import JobStore
from mlxd.supervisor.lab_files import LabFiles
from mlxd.supervisor.library import Bandwidth
from mlxd.supervisor.registry import Registry
from mlxd.supervisor.relay.dialects import render_error
from mlxd.supervisor.response_store import ResponseStore

OPEN_PATHS = frozenset({"/health", "/", "/sw.js"})  # and the web page's files, under /ui/: the page asks for a key itself
BODY_TIMEOUTS_PER_HEAD = 6  # a request body must arrive within 6 head deadlines (60 s by default)


def make_app(config: Config, registry: Registry, pool: Pool, store: ResponseStore | None = None,
             adapters: AdapterCatalog | None = None, jobs: JobStore | None = None,
             lab: LabFiles | None = None, owned: OwnedModels | None = None,
             bandwidth: Bandwidth | None = None) -> web.Application:
    """The supervisor app; its cleanup context stops every engine. `adapters`: the adapters that
    exist (default: none but those loaded by path); `jobs`: the lab's job store (default: none
    kept, none taken); `lab`: its datasets dir and token file (default: none); `owned`: where
    Ollama's pulls go and what its deletes may remove (default: nothing); `bandwidth`: where the
    machine's measured bandwidth is kept (default: in memory)."""
    metrics, server, timeline = LazyMetrics(pool), config.server, Timeline()
    hosts = HostPolicy.make(server.host, server.allowed_hosts, server.allowed_origins, machine_names())
    app = web.Application(
        client_max_size=server.max_body_bytes,
        middlewares=[make_metrics_middleware(metrics, timeline), make_error_middleware("supervisor", render_error), make_guard_middleware(hosts),
                     auth_middleware, make_body_middleware(server.max_body_bytes, server.head_timeout_s * BODY_TIMEOUTS_PER_HEAD)],
    )
    app.on_response_prepare.append(add_cors_headers)
    app[CONFIG], app[REGISTRY], app[POOL], app[METRICS], app[TIMELINE] = config, registry, pool, metrics, timeline
    app[LEASES] = Leases(pool)
    app[ADAPTERS] = catalog = adapters if adapters is not None else AdapterCatalog(None)

    def made(_: Made) -> None:  # a finished job's adapter or model is served at once
        catalog.refresh()
        registry.refresh()

    app[LAB_FILES] = lab_files = lab if lab is not None else LabFiles(None)
    app[OWNED] = owned
    app[LIBRARY] = bandwidth if bandwidth is not None else Bandwidth(None, pool.engine_env)

    def worker_env(job: Job) -> dict[str, str]:  # a job's secrets: never in its files or its log
        if job.kind == "dataset" and (keys := server.api_keys or server.admin_keys):
            return {DATASET_KEY_ENV: keys[0]}  # it calls this supervisor's /v1
        if job.kind == "push" and (token := lab_files.token()):
            return {"HF_TOKEN": token}
        return {}

    app[JOBS] = JobRunner(jobs if jobs is not None else JobStore(None), app[LEASES], made, worker_env)
    app[AUTH] = Auth(config.server.api_keys, config.server.admin_keys, config.server.key_priorities)
    app[IMAGES] = ImageFetcher(server.image_fetch_timeout_s, server.image_fetch_max_bytes, server.image_fetch_private)
    setup_openai_routes(app)
    setup_anthropic_routes(app)
    setup_ollama_routes(app)
    setup_library_routes(app)
    setup_ollama_model_routes(app)
    setup_responses_routes(app, store)
    setup_service_routes(app)
    app.router.add_get("/openapi.json", openapi_json)
    setup_admin_routes(app)
    setup_adapter_routes(app)
    setup_lab_routes(app)
    setup_lab_data_routes(app)
    setup_web_routes(app)
    app.cleanup_ctx.append(engines_ctx)
    return app


async def engines_ctx(app: web.Application) -> AsyncIterator[None]:
    """Engines live while the app does: all are stopped (gracefully, then killed) at shutdown."""
    app[POOL].spare_timing.arm()  # a spare engine for the first model, once start-up is over (1 s quiet)
    await app[JOBS].start()  # queued jobs run; one left running is adopted or marked failed
    yield
    await app[JOBS].stop()  # a running worker keeps running: the next supervisor adopts it
    app[LEASES].end_all()
    await app[IMAGES].close()
    await app[POOL].stop_all()


def is_open(request: web.Request) -> bool:
    """A path any caller may GET without a key: the liveness probe and the web page's own files."""
    return request.path in OPEN_PATHS or (request.method in ("GET", "HEAD") and request.path.startswith("/ui/"))


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every route but /health needs a key when keys are configured (admin routes, an admin key)."""
    if not is_open(request) and not request.app[AUTH].check(
        request.headers, admin=request.path.startswith("/admin/") or is_admin_route(request) or is_lab_route(request)
    ):
        raise APIError(401, "Missing or invalid API key (send `Authorization: Bearer KEY` or `x-api-key`).",
                       type="authentication_error", code="invalid_api_key")
    return await handler(request)
