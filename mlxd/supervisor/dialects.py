"""The APIs callers speak to the supervisor, and what differs between them for the relay.

Every route answers errors in its caller's API: OpenAI's `{"error": {...}}` on the OpenAI
routes (and the Responses API, which shares it), Anthropic's `{"type": "error", ...}` under
`/v1/messages` (auth failures, unknown routes and oversize bodies included, so the path
decides). A stream already under way ends with the same error as an SSE event.

A `Translation` is how one request in another API goes through an engine that speaks
OpenAI chat: the engine route it is sent to, the translator of a streamed answer (chat
chunks in, the caller's events out), and the converter of a whole one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from aiohttp import web

from mlxd.protocol import anthropic
from mlxd.protocol.errors import APIError, encode_openai_error


class Dialect(Protocol):
    name: str

    def error_response(self, err: APIError) -> web.Response: ...

    def error_event(self, err: APIError) -> bytes: ...


class OpenAIDialect:
    name = "openai"

    def error_response(self, err: APIError) -> web.Response:
        return web.Response(status=err.status, body=encode_openai_error(err), content_type="application/json",
                            headers=err.headers)

    def error_event(self, err: APIError) -> bytes:
        return b"data: " + encode_openai_error(err) + b"\n\n"


class AnthropicDialect:
    name = "anthropic"

    def error_response(self, err: APIError) -> web.Response:
        body = anthropic.error_body(err.status, err.message)
        return web.Response(status=err.status, body=msgspec.json.encode(body), content_type="application/json",
                            headers=err.headers)

    def error_event(self, err: APIError) -> bytes:
        return anthropic.error_event(err.status, err.message)


OPENAI = OpenAIDialect()
ANTHROPIC = AnthropicDialect()


def dialect_of(request: web.Request) -> Dialect:
    """The caller's API, by path."""
    path = request.path
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return ANTHROPIC
    return OPENAI


def render_error(request: web.Request, err: APIError) -> web.Response:
    """The error middleware's answer: `err` in the caller's API."""
    return dialect_of(request).error_response(err)


class StreamTranslator(Protocol):
    """Chat chunks in, the caller's stream events out (SSE bytes)."""

    ended: bool

    def start(self) -> bytes: ...

    def feed(self, chunk: dict[str, Any]) -> bytes: ...

    def finish(self) -> bytes: ...

    def fail(self, status: int, message: str, code: str | None) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Translation:
    path: str  # the engine route the translated body goes to
    dialect: Dialect
    stream: Callable[[], StreamTranslator] | None  # None: the answer is never a stream
    whole: Callable[[int, bytes], Awaitable[tuple[int, bytes]]]  # the engine's status and body -> the caller's
    # After `finish` and before its events are sent (the Responses store writes then)
    on_final: Callable[[StreamTranslator], Awaitable[None]] | None = None
    # The engine's error `param` names a chat field: (chat prefix, the caller's) renames it
    params: tuple[tuple[str, str], ...] = ()

    def error(self, status: int, data: bytes) -> APIError:
        """The engine's error answer, its `param` in the caller's field names."""
        err = engine_error(status, data)
        for chat, theirs in self.params:
            if err.param is not None and (err.param == chat or err.param.startswith(chat + ".")):
                err.param = theirs + err.param[len(chat):]
                break
        return err


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
