"""The Responses API's stream events: from the engine's chat chunks (`ResponseStream`), or
replayed from a stored Response (`replay`). responses.py has the request and whole-answer
side. Pure: no I/O."""

from __future__ import annotations

from typing import Any

from mlxd.protocol.chat_chunks import ChatChunk, ToolCallDelta
from mlxd.protocol.responses import (
    DONE,
    Shell,
    message_item,
    new_id,
    output_text,
    reasoning_item,
    sse,
    usage_of,
)


class ResponseStream:
    """Turns the engine's chat chunks (chat_chunks.py) into the Responses event sequence.

    Output items open as their kind of content begins (reasoning, then the message, then one
    item a tool call), each with its added / delta / done events, and close when another
    begins and at the end. `finish` closes them and builds the final Response (`response`),
    which the caller stores before sending the closing events it returns.
    """

    def __init__(self, shell: Shell) -> None:
        self.shell = shell
        self.ended = False
        self.response: dict[str, Any] | None = None  # the final Response, once finished
        self._seq = 0
        self._started = False
        self._output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._text = ""
        self._tool_index: int | None = None
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse(data)

    def start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        snapshot = self.shell.response("in_progress", [])
        return self._event("response.created", response=snapshot) + self._event("response.in_progress",
                                                                                response=snapshot)

    def feed(self, chunk: ChatChunk) -> bytes:
        out = [self.start()]
        for choice in chunk.choices:
            delta = choice.delta
            if text := delta.reasoning_content:
                out.append(self._begin("reasoning"))
                out.append(self._delta(text))
            if text := delta.content:
                out.append(self._begin("message"))
                out.append(self._delta(text))
            for call in delta.tool_calls or []:
                out.append(self._call(call))
            if choice.finish_reason:
                self._finish = choice.finish_reason
        if chunk.usage:
            self._usage = chunk.usage
        return b"".join(out)

    def finish(self) -> bytes:
        """Close the open item and build `response`; the closing events (completed or
        incomplete, then [DONE]) are returned, to send once it is stored."""
        if self.ended:
            return b""
        self.ended = True
        incomplete = self._finish == "length"
        out = [self.start(), self._end("incomplete" if incomplete else "completed")]
        status = "incomplete" if incomplete else "completed"
        self.response = self.shell.response(status, self._output, usage_of(self._usage),
                                            incomplete="max_output_tokens" if incomplete else None)
        out.append(self._event(f"response.{status}", response=self.response))
        return b"".join(out) + DONE

    def fail(self, status: int, message: str, code: str | None) -> bytes:
        """An error mid-stream: the `error` event (in both OpenAI's flat and the Open Responses
        nested shape), then `response.failed`, then [DONE]."""
        if self.ended:
            return b""
        self.ended = True
        kind = "server_error" if status >= 500 else "invalid_request_error"
        error = {"type": kind, "code": code or kind, "message": message, "param": None}
        out = [self.start(), self._end("incomplete"),
               self._event("error", code=error["code"], message=message, param=None, error=error)]
        self.response = self.shell.response("failed", self._output, usage_of(self._usage),
                                            error={"code": error["code"], "message": message})
        out.append(self._event("response.failed", response=self.response))
        return b"".join(out) + DONE

    # items

    def _begin(self, kind: str) -> bytes:
        if self._open is not None and self._open["type"] == kind:
            return b""
        out = self._end("completed")
        index = len(self._output)
        if kind == "message":
            item = message_item("", "in_progress")
            item["content"] = []
            part = output_text("")
        else:
            item = reasoning_item("")
            item["content"], item["status"] = [], "in_progress"
            part = {"type": "reasoning_text", "text": ""}
        self._open, self._text = item, ""
        return out + self._event("response.output_item.added", output_index=index, item=dict(item)) + self._event(
            "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part)

    def _delta(self, text: str) -> bytes:
        assert self._open is not None
        self._text += text
        index = len(self._output)
        if self._open["type"] == "message":
            return self._event("response.output_text.delta", item_id=self._open["id"], output_index=index,
                               content_index=0, delta=text, logprobs=[])
        return self._event("response.reasoning_text.delta", item_id=self._open["id"], output_index=index,
                           content_index=0, delta=text)

    def _call(self, call: ToolCallDelta) -> bytes:
        out = []
        index, fn = call.index, call.function
        if self._open is None or self._open["type"] != "function_call" or index != self._tool_index:
            out.append(self._end("completed"))
            item = self.shell.call(call.id or new_id("call"), fn.name or "", "", "in_progress")
            self._open, self._tool_index, self._text = item, index, ""
            out.append(self._event("response.output_item.added", output_index=len(self._output), item=dict(item)))
        if args := fn.arguments:
            assert self._open is not None
            self._text += args
            out.append(self._event("response.function_call_arguments.delta", item_id=self._open["id"],
                                   output_index=len(self._output), delta=args))
        return b"".join(out)

    def _end(self, status: str) -> bytes:
        item = self._open
        if item is None:
            return b""
        index, text = len(self._output), self._text
        self._open, self._tool_index, self._text = None, None, ""
        item["status"] = status
        out: list[bytes] = []
        if item["type"] == "function_call":
            item["arguments"] = text or "{}"
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        else:
            if item["type"] == "message":
                part = output_text(text)
                out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                       content_index=0, text=text, logprobs=[]))
            else:
                part = {"type": "reasoning_text", "text": text}
                out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                       content_index=0, text=text))
            item["content"] = [part]
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part))
        self._output.append(item)
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return b"".join(out)


def replay(response: dict[str, Any]) -> bytes:
    """A stored Response as the event sequence a stream of it would have been (each item's
    content in one delta): `GET /v1/responses/{id}?stream=true`."""
    seq = 0
    out: list[bytes] = []

    def event(kind: str, **fields: Any) -> None:
        nonlocal seq
        out.append(sse({"type": kind, "sequence_number": seq, **fields}))
        seq += 1

    started = {**response, "status": "in_progress", "output": [], "usage": None, "completed_at": None}
    event("response.created", response=started)
    event("response.in_progress", response=started)
    for index, item in enumerate(response.get("output") or []):
        event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", **(
            {"content": []} if "content" in item else {}), **({"arguments": ""} if "arguments" in item else {})})
        if item["type"] == "function_call":
            event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                  delta=item["arguments"])
            event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                  name=item["name"], arguments=item["arguments"])
        else:
            for j, part in enumerate(item.get("content") or []):
                kind = "output_text" if part["type"] == "output_text" else "reasoning_text"
                empty = {**part, "text": ""}
                event("response.content_part.added", item_id=item["id"], output_index=index, content_index=j,
                      part=empty)
                event(f"response.{kind}.delta", item_id=item["id"], output_index=index, content_index=j,
                      delta=part["text"], **({"logprobs": []} if kind == "output_text" else {}))
                event(f"response.{kind}.done", item_id=item["id"], output_index=index, content_index=j,
                      text=part["text"], **({"logprobs": []} if kind == "output_text" else {}))
                event("response.content_part.done", item_id=item["id"], output_index=index, content_index=j, part=part)
        event("response.output_item.done", output_index=index, item=item)
    status = response.get("status")
    event("response.failed" if status == "failed" else "response.incomplete" if status == "incomplete"
          else "response.completed", response=response)
    return b"".join(out) + DONE
