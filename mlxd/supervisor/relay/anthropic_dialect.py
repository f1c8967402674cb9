"""Anthropic's Messages API as a dialect: chat on the engine, Anthropic's shapes for the caller."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import msgspec

from mlxd.protocol import anthropic
from mlxd.protocol.anthropic_stream import MessageStream
from mlxd.protocol.errors import APIError
from mlxd.protocol.process import CHAT_PATH, EARLY_USAGE_HEADER, RENDER_PATH
from mlxd.supervisor.relay.dialect import Dialect, ModelRow, StreamTranslator

# the engine's chat field names, as this API calls them (in error messages' `param`)
PARAMS = (("response_format.json_schema.schema", "output_config.format.schema"),
          ("response_format", "output_config.format"), ("stop", "stop_sequences"),
          ("reasoning_effort", "output_config.effort"))


class AnthropicMessages(Dialect):
    """POST /v1/messages, for `model` (the name the caller gave, echoed in its answer)."""

    name = "anthropic"
    engine_path = CHAT_PATH
    engine_headers: ClassVar[dict[str, str]] = {EARLY_USAGE_HEADER: "1"}  # message_start: the prompt's tokens
    params = PARAMS
    request_headers = ("Anthropic-Version", "Anthropic-Beta", "Anthropic-Dangerous-Direct-Browser-Access")

    def __init__(self, model: str = "") -> None:
        self.model = model
        self._translator: MessageStream | None = None

    def error_body(self, err: APIError) -> bytes:
        return msgspec.json.encode(anthropic.error_body(err.status, err.message))

    def error_event(self, err: APIError) -> bytes:
        if self._translator is not None:
            return self._translator.fail(err.status, err.message, err.code)
        return anthropic.error_event(err.status, err.message)

    def translator(self) -> StreamTranslator:
        if self._translator is None:
            self._translator = MessageStream(self.model)
        return self._translator

    async def whole(self, status: int, data: bytes) -> tuple[int, bytes]:
        return status, msgspec.json.encode(anthropic.from_chat(msgspec.json.decode(data), self.model))

    def model_list(self, rows: Sequence[ModelRow], now: int) -> msgspec.Struct:
        return anthropic.model_card_list([row.entry.id for row in rows])


class AnthropicCountTokens(AnthropicMessages):
    """POST /v1/messages/count_tokens: the prompt rendered and counted by the engine."""

    name = "anthropic.count_tokens"
    engine_path = RENDER_PATH

    async def whole(self, status: int, data: bytes) -> tuple[int, bytes]:
        rendered = msgspec.json.decode(data)
        return status, msgspec.json.encode(anthropic.InputTokens(int(rendered["prompt_tokens"])))
