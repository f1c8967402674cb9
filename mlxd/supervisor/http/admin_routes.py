"""Admin handlers: engines, load, unload, drain, and job leases (admin key when keys are set)."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, TypeVar

import msgspec
import psutil
from aiohttp import web

from mlxd.protocol import supervisor_api as api
from mlxd.protocol.engine_state import LOADED, SERVING, EngineState
from mlxd.protocol.errors import APIError
from mlxd.protocol.json_body import decode_as
from mlxd.supervisor.engines.pool import Pool, Slot
from mlxd.supervisor.engines.spare import Spare
from mlxd.supervisor.http.answers import json_answer
from mlxd.supervisor.http.keys import LEASES, POOL, REGISTRY, TIMELINE
from mlxd.supervisor.registry import ModelEntry, sampling_of

T = TypeVar("T")
Seconds = Annotated[float, msgspec.Meta(gt=0, le=7 * 24 * 3600)]
ModelName = Annotated[str, msgspec.Meta(min_length=1)]  # "" would mean "the default model" to the registry


class LoadBody(msgspec.Struct, forbid_unknown_fields=True):
    model: ModelName
    pin: bool | None = None


class UnloadBody(msgspec.Struct, forbid_unknown_fields=True):
    model: ModelName
    force: bool = False


class DrainBody(msgspec.Struct, forbid_unknown_fields=True):
    model: ModelName | None = None


class LeaseBody(msgspec.Struct, forbid_unknown_fields=True):
    model: ModelName | None
    ttl_s: Seconds = 300.0
    holder: str = ""


class RenewBody(msgspec.Struct, forbid_unknown_fields=True):
    ttl_s: Seconds | None = None


async def decode(request: web.Request, kind: type[T], empty_ok: bool = False) -> T:
    """The JSON body as `kind`; 400 naming the field when it is not."""
    raw = await request.read()
    if not raw.strip() and empty_ok:
        raw = b"{}"
    return decode_as(raw, kind)


def resolve(request: web.Request, model: str) -> ModelEntry:
    """The registry's entry for `model` (404 listing what exists)."""
    registry = request.app[REGISTRY]
    registry.refresh()
    return registry.resolve(model)


def engine_info(pool: Pool, slot: Slot, lease: api.Lease | None) -> api.EngineRow:
    """One row of GET /admin/engines."""
    engine = slot.engine
    rss = None
    if engine.pid is not None:
        try:
            rss = psutil.Process(engine.pid).memory_info().rss
        except psutil.Error:
            rss = None
    up_since = engine.ready_since if engine.state is not EngineState.STOPPED else None
    retry_in_s = engine.retry_in_s()
    lanes = engine.lanes if engine.state in SERVING else None
    went_on, gave_up = pool.resumes.get(slot.entry.id, (0, 0))
    return api.EngineRow(
        model=slot.entry.id, state=engine.state, pid=engine.pid,
        uptime_s=round(time.time() - up_since, 3) if up_since is not None else None,
        rss_bytes=rss, memory_estimate_bytes=slot.memory_bytes,
        in_flight=slot.in_flight, queued=pool.num_queued(slot.entry.id),
        last_used=slot.last_used_wall, pinned=slot.pinned, restarts=engine.num_restarts,
        resumes=went_on, resume_failures=gave_up,
        idle_ttl_s=slot.idle_ttl_s, expires_in_s=pool.next_expiry(slot), batch=slot.entry.batch,
        width=lanes.width if lanes else None, kv_budget_tokens=lanes.kv_budget_tokens if lanes else None,
        sizing=lanes.sizing if lanes else None,
        closing=slot.closing, failure=engine.failure, boot=engine.boot_timings or None,
        retry_at=round(time.time() + retry_in_s, 3) if retry_in_s is not None else None,
        retry_in_s=round(retry_in_s, 3) if retry_in_s is not None else None,
        last_stop=slot.last_stop,
        lease=api.EngineLease(lease.id, lease.holder, lease.expires_at) if lease else None,
        prompt_cache=engine.prompt_cache if engine.state in SERVING else None,
        load=engine.load_progress(),
        sampling=sampling_of(slot.entry),
        hosts=list(engine.ranks.hosts_memory) if engine.ranks is not None and engine.ranks.spec.hosts else None,
    )


def spare_info(spare: Spare) -> api.Spare:
    """The spare engine process, if one lives: its pid, and whether its imports are done."""
    # Between its death and its reaping (a moment) a spare's pid is dead, never warm.
    alive = spare.pid is not None and is_alive(spare.pid)
    return api.Spare(spare.pid if alive else None, alive and spare.is_warm)


def is_alive(pid: int) -> bool:
    """Whether the process runs (a zombie has died)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


async def engines(request: web.Request) -> web.Response:
    """GET /admin/engines: every engine the pool has seen, with its memory and queue."""
    pool, leases = request.app[POOL], request.app[LEASES]
    await asyncio.gather(*(s.engine.fetch_stats() for s in pool.slots()))
    data = [engine_info(pool, s, leases.for_model(s.entry.id)) for s in pool.slots()]
    return json_answer(api.EngineList(
        "list", budget_bytes=pool.limits.budget_bytes, used_bytes=pool.used_bytes(),
        max_loaded=pool.limits.max_loaded, machine_leased=pool.machine.is_held,
        evictions=pool.num_evictions, spare=spare_info(pool.spare), data=data,
    ))


async def timeline(request: web.Request) -> web.Response:
    """GET /admin/timeline: each model's generated tokens, requests and time to first token, in
    buckets over the last minutes (the web page's charts)."""
    return json_answer(request.app[TIMELINE].view(time.time()))


async def load(request: web.Request) -> web.Response:
    """POST /admin/load {"model", "pin"?}: answers once the engine is READY."""
    body = await decode(request, LoadBody)
    entry = resolve(request, body.model)
    started = time.perf_counter()
    slot = await request.app[POOL].admin.load(entry, body.pin)
    return json_answer(api.LoadAnswer(entry.id, slot.engine.state, slot.pinned,
                                      load_ms=round((time.perf_counter() - started) * 1000, 1)))


async def unload(request: web.Request) -> web.Response:
    """POST /admin/unload {"model", "force"?}: drain, then stop; a pinned model needs force."""
    body = await decode(request, UnloadBody)
    entry = resolve(request, body.model)
    pool = request.app[POOL]
    slot = pool.slot_for(entry)
    if slot.lease_id is not None:
        raise APIError(409, f"Model {entry.id} is leased ({slot.lease_id}); end the lease first.", code="model_leased")
    if slot.pinned and not body.force:
        raise APIError(409, f"Model {entry.id} is pinned; unload it with force (`mlxd unload --force`).",
                       code="model_pinned")
    slot.pinned = slot.pinned and not body.force
    was_loaded = slot.engine.state in LOADED
    report = await pool.admin.unload(slot) if was_loaded else None  # carries on if the caller leaves
    return json_answer(api.UnloadAnswer(entry.id, slot.engine.state, was_loaded, drain=report))


async def drain(request: web.Request) -> web.Response:
    """POST /admin/drain {"model"?}: drain one engine or all; they serve again afterwards."""
    body = await decode(request, DrainBody, empty_ok=True)
    pool = request.app[POOL]
    if body.model is not None:
        slots = [pool.slot_for(resolve(request, body.model))]
    else:
        slots = [s for s in pool.slots() if s.engine.state is EngineState.READY]
    reports = await asyncio.gather(*(pool.admin.drain(s) for s in slots))
    drained = [api.model_drain(s.entry.id, r) for s, r in zip(slots, reports, strict=True) if r is not None]
    return json_answer(api.DrainAnswer(drained))


async def list_leases(request: web.Request) -> web.Response:
    """GET /admin/leases: held leases, then recently ended ones."""
    return json_answer(api.LeaseList("list", request.app[LEASES].all()))


async def take_lease(request: web.Request) -> web.Response:
    """POST /admin/leases {"model" | null, "ttl_s", "holder"}: answers once the lease is held."""
    body = await decode(request, LeaseBody)
    entry = resolve(request, body.model) if body.model is not None else None
    lease = await request.app[LEASES].take(entry, body.ttl_s, body.holder)
    return json_answer(lease)


async def renew_lease(request: web.Request) -> web.Response:
    """POST /admin/leases/{id}/renew {"ttl_s"?}."""
    body = await decode(request, RenewBody, empty_ok=True)
    lease = request.app[LEASES].renew(request.match_info["lease_id"], body.ttl_s)
    return json_answer(lease)


async def end_lease(request: web.Request) -> web.Response:
    """DELETE /admin/leases/{id}."""
    lease = request.app[LEASES].end(request.match_info["lease_id"], "released")
    return json_answer(api.LeaseDeleted(lease.id, deleted=True))


def setup_admin_routes(app: web.Application) -> None:
    """Wire the /admin/* routes."""
    app.router.add_get("/admin/engines", engines)
    app.router.add_get("/admin/timeline", timeline)
    app.router.add_post("/admin/load", load)
    app.router.add_post("/admin/unload", unload)
    app.router.add_post("/admin/drain", drain)
    app.router.add_get("/admin/leases", list_leases)
    app.router.add_post("/admin/leases", take_lease)
    app.router.add_post("/admin/leases/{lease_id}/renew", renew_lease)
    app.router.add_delete("/admin/leases/{lease_id}", end_lease)
