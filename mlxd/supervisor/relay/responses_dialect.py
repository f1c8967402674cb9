"""OpenAI's Responses API as a dialect: chat on the engine, Response objects and events back.

Errors have OpenAI's shape; a stream under way ends with Responses' own events (`error`,
then `response.failed`), continuing the sequence numbers the caller has seen, whether the
failure came from the engine or while the request waited for one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from mlxd.protocol import responses
from mlxd.protocol.errors import APIError
from mlxd.protocol.process import CHAT_PATH
from mlxd.protocol.responses_stream import ResponseStream
from mlxd.supervisor.relay.dialect import Dialect, StreamTranslator

PARAMS = (("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
          ("max_tokens", "max_output_tokens"), ("messages", "input"), ("reasoning_effort", "reasoning.effort"))
Keep = Callable[[dict[str, Any]], Awaitable[None]]


async def _keep_nothing(response: dict[str, Any]) -> None:
    return None


class Responses(Dialect):
    """POST /v1/responses: one request's response `shell`, and `keep` to store what it became."""

    name = "responses"
    engine_path = CHAT_PATH
    params = PARAMS

    def __init__(self, shell: responses.Shell | None = None, keep: Keep = _keep_nothing) -> None:
        self.shell = shell
        self.keep = keep
        self._translator: ResponseStream | None = None

    def error_event(self, err: APIError) -> bytes:
        if self.shell is None:  # only the route's own dialect streams
            return super().error_event(err)
        return self.translator().fail(err.status, err.message, err.code)

    def translator(self) -> ResponseStream:
        assert self.shell is not None
        if self._translator is None:
            self._translator = ResponseStream(self.shell)
        return self._translator

    async def whole(self, status: int, data: bytes) -> tuple[int, bytes]:
        assert self.shell is not None
        response = responses.response_from_chat(self.shell, msgspec.json.decode(data))
        await self.keep(response)
        return status, msgspec.json.encode(response)

    async def on_final(self, translator: StreamTranslator) -> None:
        assert isinstance(translator, ResponseStream) and translator.response is not None
        await self.keep(translator.response)
