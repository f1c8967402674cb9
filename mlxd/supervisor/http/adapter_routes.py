"""LoRA adapters on the supervisor: list them, load one onto its model's engine, unload it.

`GET /v1/adapters` lists every adapter mlxd knows (supervisor/adapters.py), each with the models
whose engine has it loaded; `GET /v1/adapters/available?model=M` only those made for M (a chat
picker's list). `POST /v1/adapters` loads one, by `id` (a known adapter) or `path` (an adapter dir
anywhere, registered under `id` or its dir's name), onto `model` (by default the model it
records as its base): the engine is started if it is not running, the adapter read there, and
kept loaded (mounted again after a restart, booked in the model's memory) until `DELETE
/v1/adapters/{id}`. A request needs none of this: naming an adapter loads it on first use.
Loading and unloading take an admin key where keys are configured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec
from aiohttp import web

from mlxd.protocol.errors import APIError
from mlxd.protocol.json_body import decode_json
from mlxd.protocol.supervisor_api import AdapterCard, AdapterCardList, AdapterUnloaded
from mlxd.supervisor.adapters import AdapterEntry, is_for
from mlxd.supervisor.engines.pool import Pool
from mlxd.supervisor.http.answers import json_answer
from mlxd.supervisor.http.keys import ADAPTERS, POOL, REGISTRY
from mlxd.supervisor.registry import ModelEntry

ADAPTERS_ROUTE = "/v1/adapters"


class LoadRequest(msgspec.Struct, forbid_unknown_fields=True):
    id: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] | None = None
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)] | None = None


_load = msgspec.json.Decoder(LoadRequest)


def loaded_on(pool: Pool, adapter_id: str) -> list[str]:
    """The models whose engine has the adapter mounted now, or keeps it loaded."""
    models = []
    for slot in pool.slots():
        if adapter_id in pool.adapters.mounted(slot.engine) or adapter_id in pool.adapters.kept.get(slot.entry.id, {}):
            models.append(slot.entry.id)
    return models


def card(adapter: AdapterEntry, pool: Pool) -> AdapterCard:
    return AdapterCard(id=adapter.id, base_model=adapter.base_model, path=str(adapter.path), kind=adapter.kind,
                       rank=adapter.rank, scale=adapter.scale, num_layers=adapter.num_layers,
                       size_bytes=adapter.size_bytes, source=adapter.source, loaded_on=loaded_on(pool, adapter.id))


async def list_adapters(request: web.Request) -> web.Response:
    """GET /v1/adapters: every adapter mlxd knows, and where each is loaded."""
    catalog, pool = request.app[ADAPTERS], request.app[POOL]
    catalog.refresh()
    return json_answer(AdapterCardList([card(a, pool) for a in catalog.entries()]))


async def available(request: web.Request) -> web.Response:
    """GET /v1/adapters/available?model=M: the adapters made for model M (all without `model`)."""
    catalog, pool, registry = request.app[ADAPTERS], request.app[POOL], request.app[REGISTRY]
    catalog.refresh()
    model = request.query.get("model")
    entries = catalog.entries()
    if model:
        entry = registry.resolve(model)
        entries = catalog.for_model(entry, registry)
    return json_answer(AdapterCardList([card(a, pool) for a in entries]))


async def load(request: web.Request) -> web.Response:
    """POST /v1/adapters {"id"?, "path"?, "model"?}: load an adapter and keep it loaded."""
    req: LoadRequest = decode_json(_load, await request.read())
    catalog, pool, registry = request.app[ADAPTERS], request.app[POOL], request.app[REGISTRY]
    if req.path is not None:
        adapter = catalog.register(Path(req.path), req.id)
    elif req.id is not None:
        found = catalog.get(req.id)
        if found is None:
            raise APIError(400, f"Adapter '{req.id}' not found; give its `path` to load it from a dir.",
                           param="id", code="adapter_not_found")
        adapter = found
    else:
        raise APIError(400, "Give the adapter's `id`, or the `path` of its dir.", param="id")
    model = _model_for(adapter, req.model, request)
    if not is_for(adapter, model, registry):
        raise APIError(400, f"Adapter '{adapter.id}' is for {adapter.base_model}, not {model.id}.",
                       param="model", code="adapter_base_mismatch")
    async with pool.use(model) as slot:
        await pool.adapters.ensure(slot, (adapter,))
        pool.adapters.keep(slot, adapter)
    return json_answer(card(adapter, pool))


def _model_for(adapter: AdapterEntry, model: str | None, request: web.Request) -> ModelEntry:
    """The model to load `adapter` onto: `model`, else the base it records."""
    registry = request.app[REGISTRY]
    if model is not None:
        return registry.resolve(model)
    base = adapter.base_model
    if base is not None:
        found = registry.get(base) or next((e for e in registry.entries() if is_for(adapter, e)), None)
        if found is not None:
            return found
    raise APIError(400, f"Which model should adapter '{adapter.id}' be loaded on? Its config names "
                        f"{base or 'none'}; give `model`.", param="model", code="model_required")


async def unload(request: web.Request) -> web.Response:
    """DELETE /v1/adapters/{id}: unload it from every engine (requests under it finish under it)."""
    adapter_id = request.match_info["id"]
    pool = request.app[POOL]
    models = []
    for slot in pool.slots():
        kept = pool.adapters.forget(slot, adapter_id)
        if await pool.adapters.unmount(slot, adapter_id) or kept:
            models.append(slot.entry.id)
    if not models:
        raise APIError(404, f"Adapter '{adapter_id[:200]}' is not loaded.", param="id", code="adapter_not_loaded")
    return json_answer(AdapterUnloaded(adapter_id, models))


def setup_adapter_routes(app: web.Application) -> None:
    app.router.add_get(ADAPTERS_ROUTE, list_adapters)
    app.router.add_get(ADAPTERS_ROUTE + "/available", available)
    app.router.add_post(ADAPTERS_ROUTE, load)
    app.router.add_delete(ADAPTERS_ROUTE + "/{id}", unload)


def is_admin_route(request: web.Request) -> bool:
    """Loading and unloading adapters are admin calls (a path on this machine is read)."""
    return request.path.startswith(ADAPTERS_ROUTE) and request.method in ("POST", "DELETE")
