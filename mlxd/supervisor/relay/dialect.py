"""A dialect: one API a caller speaks, and everything the relay must know of it.

A dialect owns its error body, its stream's error events, its stream translator, the
whole-answer converter, its names for the engine's chat fields (an error's `param`), its
model list's shape and the headers its SDKs send (for CORS). Every error path (auth, unknown routes, oversize bodies, queue timeouts,
waiting streams, an engine dying mid-stream) asks the request's dialect, so a caller always
reads errors in its own API. The base class is OpenAI's shape; the OpenAI routes pass the
engine's answer through as it is (`engine_path` None). A translated dialect (Anthropic
Messages, Responses) is made per request: it holds that request's stream translator, so an
error event continues the events the caller has already seen.

Adding an API means a dialect here (and its paths in dialects.py) and its routes in http/.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

import msgspec
from aiohttp import web

from mlxd.protocol.capabilities import Capabilities
from mlxd.protocol.chat_chunks import ChatChunk
from mlxd.protocol.engine_state import EngineState
from mlxd.protocol.errors import APIError, encode_openai_error
from mlxd.protocol.process import RequestUsage
from mlxd.protocol.stats import LoadProgress
from mlxd.protocol.supervisor_api import ModelInfo, ModelInfoList
from mlxd.supervisor.registry import ModelEntry
from mlxd.supervisor.relay.sse import SSE_HEADERS


class StreamTranslator(Protocol):
    """Chat chunks in, the caller's stream events out (SSE bytes)."""

    ended: bool

    def start(self) -> bytes: ...

    def feed(self, chunk: ChatChunk) -> bytes: ...

    def finish(self) -> bytes: ...

    def fail(self, status: int, message: str, code: str | None) -> bytes: ...


class ModelRow(msgspec.Struct, frozen=True):
    """One model for a model list: what exists, and its engine's state if it has one."""

    entry: ModelEntry
    state: EngineState = EngineState.STOPPED
    load: LoadProgress | None = None  # while its engine starts
    sampling: dict[str, float] = msgspec.field(default_factory=dict)  # registry.sampling_of
    capabilities: Capabilities | None = None  # registry.capabilities_of


class Dialect:
    """OpenAI's error shape; the answer passes through from the engine's route of the same path."""

    name = "openai"
    engine_path: str | None = None  # the engine route a translated body goes to; None: the same path
    engine_headers: ClassVar[dict[str, str]] = {}  # what it asks of the engine's answer (process.EARLY_USAGE_HEADER)
    # The engine's error `param` names a chat field: (chat prefix, the caller's name for it)
    params: tuple[tuple[str, str], ...] = ()
    # Headers this API's SDKs send from a browser (the CORS preflight allows them)
    request_headers: tuple[str, ...] = (
        "OpenAI-Organization", "OpenAI-Project", "X-Stainless-Arch", "X-Stainless-Lang", "X-Stainless-OS",
        "X-Stainless-Package-Version", "X-Stainless-Runtime", "X-Stainless-Runtime-Version",
        "X-Stainless-Retry-Count", "X-Stainless-Timeout")

    # The head of a streamed answer (server-sent events; Ollama's NDJSON has its own)
    stream_headers: dict[str, str] = SSE_HEADERS

    def comment(self, text: bytes) -> bytes:
        """A keep-alive or waiting note in this API's stream (an SSE comment; b"": it has none)."""
        return text

    def error_body(self, err: APIError) -> bytes:
        return encode_openai_error(err)

    def error_response(self, err: APIError) -> web.Response:
        return web.Response(status=err.status, body=self.error_body(err), content_type="application/json",
                            headers=err.headers)

    def error_event(self, err: APIError) -> bytes:
        """The event that ends a stream under way with `err` (the 200 has gone out)."""
        return b"data: " + self.error_body(err) + b"\n\n"

    def engine_error(self, status: int, data: bytes) -> APIError:
        """The engine's error answer (OpenAI-shaped), its `param` in this API's field names."""
        err = engine_error(status, data)
        for chat, theirs in self.params:
            if err.param is not None and (err.param == chat or err.param.startswith(chat + ".")):
                err.param = theirs + err.param[len(chat):]
                break
        return err

    def translator(self) -> StreamTranslator | None:
        """This request's stream translator (the same one each call); None: passed through."""
        return None

    async def whole(self, status: int, data: bytes) -> tuple[int, bytes]:
        """The engine's whole 200 answer in this API."""
        return status, data

    def engine_usage(self, usage: RequestUsage | None) -> None:
        """What a whole answer cost, as the engine said (before `whole` is asked)."""

    async def on_final(self, translator: StreamTranslator) -> None:
        """After the stream's `finish` and before its closing events go out."""

    def model_list(self, rows: Sequence[ModelRow], now: int) -> msgspec.Struct:
        """GET /v1/models in this API's shape (OpenAI's, with mlxd's fields)."""
        data = [
            ModelInfo(row.entry.id, "model", created=now, owned_by="mlxd", loaded=row.state is EngineState.READY,
                      state=row.state, source=row.entry.source, size_bytes=row.entry.size_bytes, load=row.load,
                      sampling=row.sampling, context_window=row.capabilities.context_window if row.capabilities else None,
                      capabilities=row.capabilities.capabilities if row.capabilities else [])
            for row in rows
        ]
        return ModelInfoList("list", data)


class OpenAIChat(Dialect):
    """POST /v1/chat/completions."""

    name = "openai.chat"


class OpenAICompletions(Dialect):
    """POST /v1/completions."""

    name = "openai.completions"


def engine_error(status: int, data: bytes) -> APIError:
    """An engine's OpenAI-shaped error answer as an APIError (to re-encode in another API)."""
    try:
        detail = msgspec.json.decode(data).get("error")
    except (msgspec.DecodeError, AttributeError):
        detail = None
    if not isinstance(detail, dict):
        detail = {}
    return APIError(status, str(detail.get("message") or f"The engine answered {status}."),
                    type=str(detail.get("type") or "server_error"), param=detail.get("param"), code=detail.get("code"))
