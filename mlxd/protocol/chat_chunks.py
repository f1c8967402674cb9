"""The engine's streamed chat chunks as the supervisor's translators read them.

Only the fields a translator uses, all optional: the engine's own encoder (openai.py's
ChatCompletionChunk) leaves out what a chunk does not carry. `stop_reason` is mlxd's: the stop
string that ended the answer, on the chunk with `finish_reason`.
"""

from __future__ import annotations

from typing import Any

import msgspec


class FunctionDelta(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct):
    index: int = 0
    id: str | None = None
    function: FunctionDelta = msgspec.field(default_factory=FunctionDelta)


class ChunkDelta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(msgspec.Struct):
    delta: ChunkDelta = msgspec.field(default_factory=ChunkDelta)
    text: str | None = None  # a text completion's chunk (no delta)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatChunk(msgspec.Struct):
    """One `chat.completion.chunk` (or an error event: `error` set, no choices)."""

    choices: list[ChunkChoice] = msgspec.field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


chunk_decoder = msgspec.json.Decoder(ChatChunk)
