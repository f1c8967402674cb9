"""The engine's adapter admin: list, mount and unmount LoRA adapters (the supervisor's calls).

Mounting reads the adapter's weights and changes its layers' class, so it runs on the GPU thread
between turns (Gateway.call); requests already running keep the adapters they started with.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from mlxd.engine.http.keys import GATEWAY
from mlxd.engine.http.openai_requests import decode_body, json_response, ready_model
from mlxd.engine.models.adapters import Adapter, AdapterError
from mlxd.protocol.errors import APIError
from mlxd.protocol.process import ADAPTERS_PATH, AdapterInfo, AdapterList, AdapterMount


def info(adapter: Adapter) -> AdapterInfo:
    layers = {name.split(".layers.")[1].split(".")[0] for name in adapter.modules if ".layers." in name}
    return AdapterInfo(adapter.id, str(adapter.path), adapter.kind, adapter.rank, adapter.scale, len(layers),
                       adapter.nbytes)


async def list_adapters(request: web.Request) -> web.Response:
    """GET /admin/adapters: the adapters mounted now."""
    bank = ready_model(request).adapters
    return json_response(AdapterList([info(a) for a in list(bank.mounted.values())]))


async def mount(request: web.Request) -> web.Response:
    """POST /admin/adapters {"id", "path"}: read the adapter and serve it under `id`."""
    req = await decode_body(request, AdapterMount)
    bank = ready_model(request).adapters
    try:
        adapter = await asyncio.wrap_future(request.app[GATEWAY].call(lambda: bank.mount(req.id, Path(req.path))))
    except AdapterError as exc:
        raise APIError(400, f"Adapter '{req.id}' cannot be loaded: {exc}", param="adapter",
                       code="adapter_invalid") from None
    return json_response(info(adapter))


async def unmount(request: web.Request) -> web.Response:
    """DELETE /admin/adapters/{id}: stop serving it (requests running under it finish under it)."""
    adapter_id = request.match_info["id"]
    bank = ready_model(request).adapters
    if not await asyncio.wrap_future(request.app[GATEWAY].call(lambda: bank.unmount(adapter_id))):
        raise APIError(404, f"Adapter '{adapter_id}' is not loaded.", param="adapter", code="adapter_not_found")
    return json_response({"id": adapter_id, "unloaded": True})


def setup_adapter_routes(app: web.Application) -> None:
    app.router.add_get(ADAPTERS_PATH, list_adapters)
    app.router.add_post(ADAPTERS_PATH, mount)
    app.router.add_delete(ADAPTERS_PATH + "/{id}", unmount)
