"""Ollama's answers: the lines of a chat or generate answer (a whole answer is its last line),
the model lists, and `OllamaStream`, which turns the engine's chat chunks into NDJSON lines.
The request side is ollama.py's. Pure: no I/O.

Durations are nanoseconds. In a stream they are measured at the supervisor:
`prompt_eval_duration` from the request's arrival to its first token (queueing and a model
load included), `eval_duration` from there to the last. A whole answer carries the engine's
own split (queued and prefilled, then decoded).
"""

from __future__ import annotations

import array
import base64
import json
import sys
import time
from datetime import UTC, datetime
from typing import Any, Literal

import msgspec

from mlxd.protocol.chat_chunks import ChatChunk

OLLAMA_VERSION = "0.12.0"  # the Ollama API version these routes follow (clients check /api/version)
NDJSON_HEADERS = {"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class FunctionOut(msgspec.Struct):
    index: int
    name: str
    arguments: dict[str, Any]


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionOut


class MessageOut(msgspec.Struct, omit_defaults=True):
    role: str
    content: str
    thinking: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class Done(msgspec.Struct, omit_defaults=True, kw_only=True):
    """The last line's counts and durations (nanoseconds), absent from the lines before it."""

    done_reason: str | None = None  # stop, length; load and unload for a request that only loads or unloads
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class ChatLine(Done, kw_only=True):
    """A chat answer, or one line of its stream (the last has `done: true`)."""

    model: str
    created_at: str
    message: MessageOut
    done: bool


class GenerateLine(Done, kw_only=True):
    """A generate answer, or one line of its stream."""

    model: str
    created_at: str
    response: str
    thinking: str | None = None
    done: bool


class EmbedAnswer(msgspec.Struct):
    """`/api/embed`: one vector per input (unit length), with Ollama's counts (nanoseconds)."""

    model: str
    embeddings: list[list[float]]
    total_duration: int = 0
    load_duration: int = 0
    prompt_eval_count: int = 0


class LegacyEmbedding(msgspec.Struct):
    """`/api/embeddings`: the one prompt's vector."""

    embedding: list[float]


class OllamaError(msgspec.Struct):
    error: str


class ModelDetails(msgspec.Struct):
    parent_model: str
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class TagModel(msgspec.Struct):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class TagList(msgspec.Struct):
    models: list[TagModel]


class RunningModel(msgspec.Struct):
    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str
    size_vram: int
    context_length: int


class RunningList(msgspec.Struct):
    models: list[RunningModel]


class ShowAnswer(msgspec.Struct):
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class PullStatus(msgspec.Struct, omit_defaults=True):
    """One line of a pull's progress (the last `success`), or a whole pull's answer."""

    status: str
    digest: str | None = None  # the file a line is about (Ollama names its layers so)
    total: int | None = None  # its bytes
    completed: int | None = None  # ... fetched so far
    model: str | None = None  # mlxd's: on `success`, the id the model is served under


class Version(msgspec.Struct):
    version: str


# ---- building answers ----


_second: list[Any] = [-1, ""]  # the last whole second formatted, and its text


def now_rfc3339() -> str:
    """Now in UTC, RFC 3339 with microseconds (each stream line has one: the second's text is kept)."""
    now = time.time()
    second = int(now)
    if second != _second[0]:
        _second[:] = [second, datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")]
    return f"{_second[1]}.{int((now - second) * 1e6):06d}Z"


def done_reason(finish: str | None) -> str:
    """Ollama's `done_reason` for the engine's `finish_reason`."""
    return "length" if finish == "length" else "stop"


class Timing:
    """A request's clock at the supervisor: arrival, first token, end (perf_counter seconds)."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.first: float | None = None
        self._engine: tuple[float, float] | None = None  # the engine's (to first token, decoding) ms

    def token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def split(self, prompt_ms: float, decode_ms: float) -> None:
        """Take the engine's own split of a whole answer's time (the supervisor saw only its end)."""
        self._engine = (prompt_ms, decode_ms)

    def done(self, finish: str | None, usage: dict[str, Any] | None) -> Done:
        end = time.perf_counter()
        first = self.first if self.first is not None else end
        usage = usage or {}
        prompt_s, decode_s = first - self.started, end - first
        if self._engine is not None:
            prompt_s, decode_s = self._engine[0] / 1000, self._engine[1] / 1000
        return Done(done_reason=done_reason(finish), total_duration=int((end - self.started) * 1e9),
                    prompt_eval_count=int(usage.get("prompt_tokens") or 0), prompt_eval_duration=int(prompt_s * 1e9),
                    eval_count=int(usage.get("completion_tokens") or 0), eval_duration=int(decode_s * 1e9))


def tool_calls_out(calls: list[dict[str, Any]]) -> list[ToolCallOut]:
    """The engine's tool calls (arguments as JSON text) as Ollama's (arguments as an object)."""
    out = []
    for index, call in enumerate(calls):
        fn = call.get("function") or {}
        text = fn.get("arguments") or "{}"
        try:
            args = json.loads(text) if isinstance(text, str) else text
        except json.JSONDecodeError:
            args = {}
        out.append(ToolCallOut(call.get("id") or f"call_{index}",
                               FunctionOut(index, fn.get("name") or "", args if isinstance(args, dict) else {})))
    return out


def line(model: str, kind: Literal["chat", "generate"], content: str = "", thinking: str | None = None,
         calls: list[ToolCallOut] | None = None, done: Done | None = None) -> ChatLine | GenerateLine:
    """One answer (or stream line): `done` the last's counts, None for a line before it."""
    end = msgspec.structs.asdict(done) if done is not None else {}
    if kind == "chat":
        return ChatLine(model=model, created_at=now_rfc3339(), message=MessageOut("assistant", content, thinking, calls),
                        done=done is not None, **end)
    return GenerateLine(model=model, created_at=now_rfc3339(), response=content, thinking=thinking,
                        done=done is not None, **end)


def answer(data: dict[str, Any], model: str, kind: Literal["chat", "generate"], timing: Timing) -> ChatLine | GenerateLine:
    """The engine's whole chat (or text) completion as Ollama's chat or generate answer."""
    choice = (data.get("choices") or [{}])[0]
    msg = choice.get("message")
    timing.token()
    text = (msg.get("content") if msg is not None else choice.get("text")) or ""
    thinking = (msg or {}).get("reasoning_content") or None
    calls = tool_calls_out(msg["tool_calls"]) if msg and msg.get("tool_calls") and kind == "chat" else None
    return line(model, kind, text, thinking, calls, timing.done(choice.get("finish_reason"), data.get("usage")))


def floats(packed: str) -> list[float]:
    """A base64 vector of little-endian float32s as floats."""
    values = array.array("f", base64.b64decode(packed))
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def embed_answer(data: dict[str, Any], model: str, legacy: bool, started: float) -> EmbedAnswer | LegacyEmbedding:
    """The engine's embeddings answer (vectors as base64 float32) as Ollama's."""
    vectors = [floats(item["embedding"]) for item in sorted(data.get("data") or [], key=lambda item: item["index"])]
    if legacy:
        return LegacyEmbedding(vectors[0] if vectors else [])
    tokens = int((data.get("usage") or {}).get("prompt_tokens") or 0)
    return EmbedAnswer(model, vectors, int((time.perf_counter() - started) * 1e9), 0, tokens)


def ndjson(obj: msgspec.Struct) -> bytes:
    return msgspec.json.encode(obj) + b"\n"


def error_body(message: str) -> bytes:
    return msgspec.json.encode(OllamaError(message))


class OllamaStream:
    """Turns the engine's chat (or text completion) chunks into Ollama's NDJSON lines.

    Text and thinking go out as they come. Tool calls arrive from the engine in pieces (the
    name, then the arguments' text); Ollama sends each call whole, so they are gathered and go
    out in one line before the last. The last line has `done: true`, the reason, the counts
    and the durations."""

    def __init__(self, model: str, kind: Literal["chat", "generate"], started: float) -> None:
        self.model = model
        self.kind = kind
        self.timing = Timing(started)
        self._calls: dict[int, dict[str, Any]] = {}
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None
        self.ended = False

    def start(self) -> bytes:
        return b""

    def feed(self, chunk: ChatChunk) -> bytes:
        out = []
        for choice in chunk.choices[:1]:
            delta = choice.delta
            text = delta.content or choice.text or ""
            if text or delta.reasoning_content:
                self.timing.token()
                out.append(ndjson(line(self.model, self.kind, text, delta.reasoning_content)))
            for call in delta.tool_calls or []:
                self.timing.token()
                got = self._calls.setdefault(call.index, {"id": call.id, "function": {"name": "", "arguments": ""}})
                got["id"] = got["id"] or call.id
                got["function"]["name"] += call.function.name or ""
                got["function"]["arguments"] += call.function.arguments or ""
            if choice.finish_reason:
                self._finish = choice.finish_reason
        if chunk.usage:
            self._usage = chunk.usage
        return b"".join(out)

    def finish(self) -> bytes:
        if self.ended:
            return b""
        self.ended = True
        out = b""
        if self._calls and self.kind == "chat":
            calls = tool_calls_out([self._calls[i] for i in sorted(self._calls)])
            out = ndjson(line(self.model, self.kind, calls=calls))
        return out + ndjson(line(self.model, self.kind, done=self.timing.done(self._finish, self._usage)))

    def fail(self, status: int, message: str, code: str | None = None) -> bytes:
        if self.ended:
            return b""
        self.ended = True
        return error_body(message) + b"\n"
