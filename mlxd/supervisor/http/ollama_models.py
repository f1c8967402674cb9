"""Ollama's `POST /api/pull` and `DELETE /api/delete`: `mlxd pull` and `mlxd rm` over HTTP.

A pull fetches an MLX model from the Hugging Face hub into the hub cache mlxd serves from
(mlxd/hub/puller.py, in a worker thread), its progress as Ollama's NDJSON status lines (one a
file as it starts, its bytes as they come, then `success`); the model is served at once. A
delete removes a model mlxd owns (its models dir, or a repo mlxd pulled: hub/removal.py),
draining its engine first. Both are admin calls (an admin key, where keys are configured).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec
from aiohttp import web

from mlxd.hub.removal import OwnedModels, RemovalError
from mlxd.protocol import ollama
from mlxd.protocol.engine_state import EngineState
from mlxd.protocol.errors import APIError
from mlxd.protocol.json_body import decode_json
from mlxd.protocol.ollama_answers import NDJSON_HEADERS, OllamaError, PullStatus
from mlxd.supervisor.http.keys import OWNED, POOL, REGISTRY
from mlxd.supervisor.registry import ModelEntry

log = logging.getLogger("mlxd.supervisor")
_model = msgspec.json.Decoder(ollama.ModelRequest)
_pull = msgspec.json.Decoder(ollama.PullRequest)
_encoder = msgspec.json.Encoder()
PROGRESS_EVERY_S = 0.25  # a file's byte count goes out at most this often


def owned(request: web.Request) -> OwnedModels:
    found = request.app[OWNED]
    if found is None:
        raise APIError(503, "This mlxd has no data dir: it cannot pull or delete models.", type="server_error")
    return found


def entry_named(request: web.Request, name: str) -> ModelEntry:
    """The model with exactly this id (`:latest` dropped), else a 404."""
    registry = request.app[REGISTRY]
    registry.refresh()
    entry = registry.get(name) or (registry.get(name.removesuffix(":latest")) if name.endswith(":latest") else None)
    if entry is None:
        raise APIError(404, f"model '{name}' not found (a delete takes the exact id: `mlxd models` lists them)")
    return entry


async def delete(request: web.Request) -> web.Response:
    """DELETE /api/delete {"model"}: drain and stop its engine, then remove its files."""
    req: ollama.ModelRequest = decode_json(_model, await request.read())
    entry = entry_named(request, req.which)
    where = owned(request)
    try:
        where.target(entry)  # refuse what mlxd does not own before stopping anything
    except RemovalError as exc:
        raise APIError(409, str(exc), code="not_owned") from None
    pool = request.app[POOL]
    slot = pool.slot_for(entry)
    if slot.lease_id is not None or slot.pinned:
        why = f"leased ({slot.lease_id})" if slot.lease_id is not None else "pinned"
        raise APIError(409, f"Model {entry.id} is {why}; end that first.", code="model_busy")
    if slot.engine.state is not EngineState.STOPPED:
        await pool.admin.unload(slot)
    try:
        target, num_bytes = await asyncio.to_thread(where.remove, entry)
    except RemovalError as exc:
        raise APIError(500, str(exc), type="server_error") from None
    request.app[REGISTRY].refresh()
    log.info("deleted %s (%s): %d bytes freed", entry.id, target, num_bytes)
    return web.Response(status=200)


class PullProgress:
    """The puller's events (a worker thread) as Ollama's status lines, handed to the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lines: asyncio.Queue[PullStatus] = asyncio.Queue()
        self._sizes: dict[str, int] = {}
        self._done: dict[str, int] = {}
        self._sent_at: dict[str, float] = {}

    def _put(self, status: PullStatus) -> None:
        self.loop.call_soon_threadsafe(self.lines.put_nowait, status)

    def started(self, repo: str, revision: str, commit: str, files: list[Any]) -> None:
        self._sizes = {f.name: f.size or 0 for f in files}
        self._put(PullStatus(f"pulling {repo}@{revision} (commit {commit[:12]}): {len(files)} files"))

    def fetching(self, file: Any, is_cached: bool) -> None:
        self._done[file.name] = self._sizes.get(file.name, 0) if is_cached else 0
        self._status(file.name, force=True)

    def resuming(self, file: Any, num_fetched: int, why: str | None) -> None:
        self._done[file.name] = num_fetched
        self._status(file.name, force=True)

    def fetched(self, file: Any) -> None:
        self._done[file.name] = self._sizes.get(file.name, self._done.get(file.name, 0))
        self._status(file.name, force=True)

    def warn(self, text: str) -> None:
        self._put(PullStatus(f"warning: {text}"))

    def on_bytes(self, name: str, num: int) -> None:
        """A file's bar moved (its progress, at most every PROGRESS_EVERY_S)."""
        self._done[name] = self._done.get(name, 0) + num
        self._status(name)

    def _status(self, name: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._sent_at.get(name, 0.0) < PROGRESS_EVERY_S:
            return
        self._sent_at[name] = now
        total = self._sizes.get(name, 0)
        self._put(PullStatus(f"pulling {name}", digest=name, total=total, completed=min(self._done.get(name, 0), total)))


async def pull(request: web.Request) -> web.StreamResponse:
    """POST /api/pull {"model": "ORG/NAME[@REVISION]", "stream"}: fetch it into the hub cache."""
    from mlxd.hub.puller import Puller, PullError, counting_bar, parse_spec

    req: ollama.PullRequest = decode_json(_pull, await request.read())
    spec = req.which.removeprefix("hf.co/").removeprefix("huggingface.co/").removesuffix(":latest")
    try:
        repo, revision = parse_spec(spec)
    except PullError as exc:
        raise APIError(400, str(exc), param="model") from None
    where = owned(request)
    progress = PullProgress(asyncio.get_running_loop())
    puller = Puller(where.cache, where.record, progress, counting_bar(progress.on_bytes))
    job = asyncio.ensure_future(asyncio.to_thread(puller.pull, repo, revision))
    job.add_done_callback(lambda _: request.app[REGISTRY].refresh())  # served at once, even if the caller left
    if not req.stream:
        try:
            result = await asyncio.shield(job)
        except PullError as exc:
            raise APIError(400, str(exc), param="model") from None
        return web.Response(body=_encoder.encode(PullStatus("success", model=result.model_id)),
                            content_type="application/json")
    resp = web.StreamResponse(headers=NDJSON_HEADERS)
    await resp.prepare(request)
    try:
        await resp.write(_encoder.encode(PullStatus("pulling manifest")) + b"\n")
        while not job.done() or not progress.lines.empty():
            getter = asyncio.ensure_future(progress.lines.get())
            await asyncio.wait({getter, job}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                await resp.write(_encoder.encode(getter.result()) + b"\n")
            else:
                getter.cancel()
        try:
            result = job.result()
        except PullError as exc:
            await resp.write(_encoder.encode(OllamaError(str(exc))) + b"\n")
        except Exception as exc:  # the head went out: the caller hears of it in a line
            log.exception("the pull of %s failed", repo)
            await resp.write(_encoder.encode(OllamaError(f"The pull failed: {type(exc).__name__}: {exc}")) + b"\n")
        else:
            await resp.write(_encoder.encode(PullStatus("success", model=result.model_id)) + b"\n")
    except ConnectionResetError:
        log.info("the caller of a pull of %s left; the pull goes on", repo)
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


def setup_ollama_model_routes(app: web.Application) -> None:
    app.router.add_post("/api/pull", pull)
    app.router.add_delete("/api/delete", delete)
