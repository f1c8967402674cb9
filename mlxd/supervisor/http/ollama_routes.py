"""Ollama's API on the supervisor's port: the same models, pool and engines as every other door.

`/api/chat` and `/api/generate` are translated to the engine's chat (or, for a `raw`
generate, text completion) API and relayed like any inference request, in Ollama's dialect
(relay/ollama_dialect.py; the mapping is protocol/ollama.py's). `keep_alive` sets how long
the model's engine stays loaded once idle, as Ollama's does; a chat without messages (or a
generate without a prompt) loads the model, or with `keep_alive: 0` unloads it.
`/api/embed` and `/api/embeddings` go to the engine's `/v1/embeddings` (an embedding model's).
`/api/tags`, `/api/ps`, `/api/show` and `/api/version` describe what there is, read from the
models' files and the pool.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import msgspec
from aiohttp import web

from mlxd.protocol import ollama, ollama_answers
from mlxd.protocol.engine_state import EngineState
from mlxd.protocol.errors import APIError
from mlxd.protocol.json_body import decode_json
from mlxd.supervisor.http.image_fetch import check_takes_images
from mlxd.supervisor.http.keys import POOL, REGISTRY
from mlxd.supervisor.http.relaying import Target, relay, resolve, resolve_target
from mlxd.supervisor.model_inspect import InspectError, inspect_model
from mlxd.supervisor.registry import ModelEntry, capabilities_of, chat_template_of, sampling_of
from mlxd.supervisor.relay.ollama_dialect import Ollama, OllamaEmbed

_chat = msgspec.json.Decoder(ollama.ChatRequest)
_generate = msgspec.json.Decoder(ollama.GenerateRequest)
_model = msgspec.json.Decoder(ollama.ModelRequest)
_encoder = msgspec.json.Encoder()
FOREVER = datetime(2318, 1, 1, tzinfo=UTC)  # an `expires_at` for a model that never unloads (Ollama's far future)
# Capabilities as Ollama names them (mlxd's "reasoning" is Ollama's "thinking").
CAPABILITY_NAMES = {"reasoning": "thinking"}


def answer(obj: msgspec.Struct) -> web.Response:
    return web.Response(body=_encoder.encode(obj), content_type="application/json")


def resolve_ollama(request: web.Request, model: str) -> Target:
    """The model an Ollama request names; `name:latest` is `name` (Ollama's clients add the tag),
    unless a model is named so; `name:adapter` runs under that adapter, as on the other routes."""
    if model.endswith(":latest"):
        try:
            resolve(request, model)
        except APIError as err:
            if err.status != 404:
                raise
            model = model.removesuffix(":latest")
    return resolve_target(request, model, None)


def keep_alive(request: web.Request, entry: ModelEntry, value: ollama.KeepAlive | None) -> int | None:
    """Apply the request's `keep_alive` to the model's engine (none: its configured idle TTL)."""
    seconds = ollama.keep_alive_seconds(value)
    request.app[POOL].keep_alive(entry, seconds)
    return seconds


async def load_or_unload(request: web.Request, entry: ModelEntry, seconds: int | None,
                         kind: Literal["chat", "generate"]) -> web.Response:
    """A chat without messages, or a generate without a prompt: load the model (keep_alive 0:
    let it go now), and say so as Ollama does."""
    if seconds == 0:
        reason = "unload"
    else:
        await request.app[POOL].admin.load(entry)
        reason = "load"
    return answer(ollama_answers.line(entry.id, kind, done=ollama_answers.Done(done_reason=reason)))


async def chat(request: web.Request) -> web.StreamResponse:
    """POST /api/chat."""
    started = time.perf_counter()
    req: ollama.ChatRequest = decode_json(_chat, await request.read())
    target = resolve_ollama(request, req.model)
    body = ollama.chat_body(req)
    image = next((f"messages[{i}].images" for i, m in enumerate(req.messages) if m.images), None)
    check_takes_images(target.entry, image)
    seconds = keep_alive(request, target.entry, req.keep_alive)
    if not req.messages:
        return await load_or_unload(request, target.entry, seconds, "chat")
    dialect = Ollama(req.model, "chat", started)
    return await relay(request, target, _encoder.encode(body), dialect, stream=req.stream, started=started)


async def generate(request: web.Request) -> web.StreamResponse:
    """POST /api/generate."""
    started = time.perf_counter()
    req: ollama.GenerateRequest = decode_json(_generate, await request.read())
    target = resolve_ollama(request, req.model)
    raw, body = ollama.generate_body(req)
    check_takes_images(target.entry, "images" if req.images else None)
    seconds = keep_alive(request, target.entry, req.keep_alive)
    if not req.prompt and not req.images:
        return await load_or_unload(request, target.entry, seconds, "generate")
    dialect = Ollama(req.model, "generate", started, raw=raw)
    return await relay(request, target, _encoder.encode(body), dialect, stream=req.stream, started=started)


# ---- what there is ----


def digest(entry: ModelEntry) -> str:
    """A stable id for the model's files as they are (its path, size and time), not a content hash."""
    try:
        mtime = (entry.path / "config.json").stat().st_mtime_ns
    except OSError:
        mtime = 0
    return hashlib.sha256(f"{entry.path}\0{entry.size_bytes}\0{mtime}".encode()).hexdigest()


def modified_at(entry: ModelEntry) -> str:
    try:
        when = (entry.path / "config.json").stat().st_mtime
    except OSError:
        when = 0.0
    return datetime.fromtimestamp(when, UTC).isoformat().replace("+00:00", "Z")


def parameter_size(count: int) -> str:
    """Ollama's way of writing a parameter count: 135M, 1.2B, 8.0B."""
    if count >= 10**9:
        return f"{count / 10**9:.1f}B"
    if count >= 10**6:
        return f"{count / 10**6:.0f}M"
    return f"{count / 10**3:.0f}K" if count >= 10**3 else str(count)


def details(entry: ModelEntry) -> tuple[ollama_answers.ModelDetails, dict[str, Any]]:
    """(Ollama's `details`, `model_info`) from the model's safetensors headers and config."""
    try:
        found = inspect_model(entry.id, entry.path)
    except InspectError:
        found = None
    family = (found.model_type if found is not None else None) or ""
    quant = found.quantization if found is not None else None
    level = (f"Q{quant.get('bits')}" if quant and quant.get("bits") else
             (found.dtype or "").upper() if found is not None else "")
    shown = ollama_answers.ModelDetails("", "safetensors", family, [family] if family else [],
                                parameter_size(found.parameters) if found is not None else "", level)
    info: dict[str, Any] = {"general.architecture": family}
    if found is not None:
        info["general.parameter_count"] = found.parameters
        if found.layers is not None:
            info[f"{family}.block_count"] = found.layers
    info[f"{family}.context_length"] = capabilities_of(entry).context_window
    return shown, info


def capabilities(entry: ModelEntry) -> list[str]:
    return [CAPABILITY_NAMES.get(c, c) for c in capabilities_of(entry).capabilities]


async def tags(request: web.Request) -> web.Response:
    """GET /api/tags: every model there is."""
    entries = [e for e in request.app[REGISTRY].entries() if e.is_available]
    shown = await asyncio.gather(*(asyncio.to_thread(details, e) for e in entries))
    return answer(ollama_answers.TagList([ollama_answers.TagModel(e.id, e.id, modified_at(e), e.size_bytes, digest(e), d)
                                  for e, (d, _) in zip(entries, shown, strict=True)]))


async def ps(request: web.Request) -> web.Response:
    """GET /api/ps: the models whose engines are loaded (or loading), and when each unloads."""
    pool = request.app[POOL]
    slots = [s for s in pool.slots() if s.engine.state in (EngineState.STARTING, EngineState.READY)]
    shown = await asyncio.gather(*(asyncio.to_thread(details, s.entry) for s in slots))
    now = datetime.now(UTC)
    models = []
    for slot, (d, _) in zip(slots, shown, strict=True):
        left = pool.next_expiry(slot)
        expires = FOREVER if left is None else now + timedelta(seconds=left)
        models.append(ollama_answers.RunningModel(
            slot.entry.id, slot.entry.id, slot.memory_bytes, digest(slot.entry), d,
            expires.isoformat().replace("+00:00", "Z"), slot.memory_bytes if pool.device != "cpu" else 0,
            capabilities_of(slot.entry).context_window))
    return answer(ollama_answers.RunningList(models))


async def show(request: web.Request) -> web.Response:
    """POST /api/show: one model's details, parameters, chat template and capabilities."""
    req: ollama.ModelRequest = decode_json(_model, await request.read())
    entry = resolve_ollama(request, req.which).entry
    shown, info = await asyncio.to_thread(details, entry)
    params = "\n".join(f"{k} {v}" for k, v in sampling_of(entry).items())
    template = await asyncio.to_thread(chat_template_of, entry) or ""
    return answer(ollama_answers.ShowAnswer(f"# mlxd serves {entry.id} from {entry.path}\nFROM {entry.path}\n", params,
                                    template, shown, info, capabilities(entry), modified_at(entry)))


_embed = msgspec.json.Decoder(ollama.EmbedRequest)


async def embed(request: web.Request) -> web.Response:
    """POST /api/embed and the older /api/embeddings: an embedding model's vectors (unit
    length), through the engine's /v1/embeddings. No input: load the model (as a chat without
    messages does)."""
    started = time.perf_counter()
    req: ollama.EmbedRequest = decode_json(_embed, await request.read())
    legacy = request.path == "/api/embeddings"
    target = resolve_ollama(request, req.model)
    seconds = keep_alive(request, target.entry, req.keep_alive)
    body = ollama.embed_body(req, legacy)
    if body is None:
        if seconds != 0:
            await request.app[POOL].admin.load(target.entry)
        return answer(ollama_answers.LegacyEmbedding([]) if legacy else ollama_answers.EmbedAnswer(req.model, []))
    dialect = OllamaEmbed(req.model, started, legacy)
    resp = await relay(request, target, _encoder.encode(body), dialect, stream=False, started=started)
    assert isinstance(resp, web.Response)
    return resp


async def version(request: web.Request) -> web.Response:
    """GET /api/version: the Ollama API version these routes follow."""
    return answer(ollama_answers.Version(ollama_answers.OLLAMA_VERSION))


def setup_ollama_routes(app: web.Application) -> None:
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)
    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/ps", ps)
    app.router.add_post("/api/show", show)
    app.router.add_get("/api/version", version)
    app.router.add_post("/api/embed", embed)
    app.router.add_post("/api/embeddings", embed)
