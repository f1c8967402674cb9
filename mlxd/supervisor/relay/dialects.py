"""Which dialect a request speaks, by its path, for the answers made before any route runs
(auth failures, unknown routes, oversize bodies) and for GET /v1/models."""

from __future__ import annotations

from aiohttp import web

from mlxd.protocol.errors import APIError
from mlxd.supervisor.relay.anthropic_dialect import AnthropicMessages
from mlxd.supervisor.relay.dialect import Dialect, OpenAIChat, OpenAICompletions
from mlxd.supervisor.relay.keys import DIALECT_KEY
from mlxd.supervisor.relay.ollama_dialect import OLLAMA, OLLAMA_PATHS
from mlxd.supervisor.relay.responses_dialect import Responses

OPENAI = OpenAIChat()
ANTHROPIC = AnthropicMessages()
# path prefix -> the dialect of everything under it (the longest prefix wins; else OpenAI's)
BY_PATH: dict[str, Dialect] = {
    "/v1/messages": ANTHROPIC, "/v1/responses": Responses(), "/v1/completions": OpenAICompletions(),
    "/v1/chat/completions": OPENAI, **dict.fromkeys(OLLAMA_PATHS, OLLAMA),
}
_LONGEST_FIRST = sorted(BY_PATH, key=len, reverse=True)  # sorted once, not per request


def dialect_of(request: web.Request) -> Dialect:
    """The caller's API, by path."""
    path = request.path
    for prefix in _LONGEST_FIRST:
        if path == prefix or path.startswith(prefix + "/"):
            return BY_PATH[prefix]
    return OPENAI


def models_dialect(request: web.Request) -> Dialect:
    """GET /v1/models answers in Anthropic's shape to a caller that sends `anthropic-version`."""
    return ANTHROPIC if "anthropic-version" in request.headers else OPENAI


def render_error(request: web.Request, err: APIError) -> web.Response:
    """The error middleware's answer: `err` in the caller's API (the route's own dialect once
    it has one, else the path's)."""
    return (request.get(DIALECT_KEY) or dialect_of(request)).error_response(err)
