"""Anthropic's stream events, from the engine's chat chunks (the translation of a streamed
`POST /v1/messages`; anthropic.py has the request and whole-answer side). Pure: no I/O."""

from __future__ import annotations

import uuid
from typing import Any

from mlxd.protocol.anthropic import error_event, new_message_id, sse, stop_reason, usage_of
from mlxd.protocol.chat_chunks import ChatChunk, ToolCallDelta

PING = sse("ping", {"type": "ping"})


class MessageStream:
    """Turns the engine's chat chunks (chat_chunks.py) into Anthropic's stream events (SSE bytes).

    `message_start` goes out with the engine's first chunk, whose usage (asked for with
    process.EARLY_USAGE_HEADER) gives it the prompt's tokens, as Anthropic's does; clients that
    track their context read them there. Blocks are numbered as they open; a block closes when
    another kind begins (text after thinking, a new tool call) and at the end. The stop reason
    comes with the chunk that carries `finish_reason`; the whole usage with the last chunk (the
    engine is asked for it), so `message_delta` and `message_stop` go out at the end.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = new_message_id()
        self._started = False
        self._block: str | None = None  # "text" | "thinking" | "tool_use" | None
        self._index = -1
        self._tool_index: int | None = None  # the engine's index of the open tool call
        self._finish: str | None = None
        self._stop: str | None = None
        self._usage: dict[str, Any] | None = None
        self.ended = False

    def start(self) -> bytes:
        """Nothing yet: `message_start` waits for the engine's first chunk (its usage)."""
        return b""

    def _message_start(self, usage: dict[str, Any] | None) -> bytes:
        """`message_start` with the prompt's usage, and a ping (sent once, before anything else)."""
        if self._started:
            return b""
        self._started = True
        counts = usage_of(usage)
        message: dict[str, Any] = {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": counts.input_tokens, "output_tokens": 0,
                      "cache_read_input_tokens": counts.cache_read_input_tokens, "cache_creation_input_tokens": 0},
        }
        return sse("message_start", {"type": "message_start", "message": message}) + PING

    def feed(self, chunk: ChatChunk) -> bytes:
        """The events for one chunk of the engine's stream."""
        out = [self._message_start(chunk.usage)]
        for choice in chunk.choices:
            delta = choice.delta
            if text := delta.reasoning_content:
                out.append(self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}))
                out.append(self._delta({"type": "thinking_delta", "thinking": text}))
            if text := delta.content:
                out.append(self._open("text", {"type": "text", "text": ""}))
                out.append(self._delta({"type": "text_delta", "text": text}))
            for call in delta.tool_calls or []:
                out.append(self._call(call))
            if choice.finish_reason:
                self._finish = choice.finish_reason
                self._stop = choice.stop_reason if isinstance(choice.stop_reason, str) else None
        if chunk.usage:
            self._usage = chunk.usage
        return b"".join(out)

    def finish(self) -> bytes:
        """The closing events (after the engine's last chunk)."""
        if self.ended:
            return b""
        self.ended = True
        reason = stop_reason(self._finish, self._stop)
        usage = usage_of(self._usage)
        delta = {"type": "message_delta",
                 "delta": {"stop_reason": reason, "stop_sequence": self._stop if reason == "stop_sequence" else None},
                 "usage": usage}
        return b"".join([self._message_start(self._usage), self._close(), sse("message_delta", delta),
                         sse("message_stop", {"type": "message_stop"})])

    def fail(self, status: int, message: str, code: str | None = None) -> bytes:
        """An error mid-stream: Anthropic's `error` event, the stream's last."""
        if self.ended:
            return b""
        self.ended = True
        return error_event(status, message)

    def _call(self, call: ToolCallDelta) -> bytes:
        out = []
        index, fn = call.index, call.function
        if self._block != "tool_use" or index != self._tool_index:
            out.append(self._close())
            self._index += 1
            self._block, self._tool_index = "tool_use", index
            block = {"type": "tool_use", "id": call.id or "toolu_" + uuid.uuid4().hex[:24],
                     "name": fn.name or "", "input": {}}
            out.append(sse("content_block_start", {"type": "content_block_start", "index": self._index,
                                                   "content_block": block}))
        if args := fn.arguments:
            out.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return b"".join(out)

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        if self._block == kind:
            return b""
        out = self._close()
        self._index += 1
        self._block = kind
        return out + sse("content_block_start", {"type": "content_block_start", "index": self._index,
                                                 "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def _close(self) -> bytes:
        if self._block is None:
            return b""
        self._block, self._tool_index = None, None
        return sse("content_block_stop", {"type": "content_block_stop", "index": self._index})
