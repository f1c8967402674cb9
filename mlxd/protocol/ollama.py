"""Ollama's API, translated to and from the engine's OpenAI chat and completions APIs.

The supervisor takes `POST /api/chat` and `POST /api/generate` in Ollama's shape and sends the
engine an OpenAI chat completion (`chat_body`, `generate_body`; a `raw` generate is a text
completion); ollama_answers.py turns the answer back, whole or as NDJSON lines. Pure
functions and types: no I/O.

What maps to what:
  * `options`: `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`, `presence_penalty`
    and `frequency_penalty` as they are; `num_predict` is `max_tokens` (-1 and -2: as much as
    the context holds); `repeat_penalty` is `repetition_penalty`, `repeat_last_n` its window
    (0: no penalty, -1: the whole context). Ollama's runner settings
    (`num_ctx`, `num_gpu`, `num_thread`, `mirostat`, ...) are accepted and not used: mlxd
    sizes its engines itself.
  * `format`: `"json"` is a JSON object, a schema is that schema (the engine's grammar).
  * `think`: `false` turns the template's thinking off, `true` on; a level (`"low"`,
    `"medium"`, `"high"`) is `reasoning_effort` with thinking on. The reasoning comes back as
    `thinking`.
  * `tools` are OpenAI's function tools already; a message's `tool_calls` carry arguments as
    an object (the engine's as a JSON string) and a `tool` message's `tool_name` is its name.
  * `images` (base64, no data: prefix) become `image_url` parts.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from mlxd.protocol.errors import APIError


class OllamaOptions(msgspec.Struct, kw_only=True):
    """The `options` mlxd honours; the rest of Ollama's (runner settings) are accepted and unused."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: list[str] | str | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class OllamaFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: dict[str, Any] | str = msgspec.field(default_factory=dict)


class OllamaToolCall(msgspec.Struct, kw_only=True):
    function: OllamaFunction
    id: str | None = None


class OllamaMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    thinking: str | None = None
    tool_name: str | None = None


Format = Literal["", "json"] | dict[str, Any]
KeepAlive = float | str
Think = bool | Annotated[str, Meta(max_length=32)]


class ChatRequest(msgspec.Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    messages: list[OllamaMessage] = msgspec.field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    format: Format | None = None
    options: OllamaOptions | None = None
    stream: bool = True
    keep_alive: KeepAlive | None = None
    think: Think | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None  # the deprecated continuation: accepted, not used
    raw: bool = False
    images: list[str] | None = None
    format: Format | None = None
    options: OllamaOptions | None = None
    stream: bool = True
    keep_alive: KeepAlive | None = None
    think: Think | None = None


class EmbedRequest(msgspec.Struct, kw_only=True):
    """`/api/embed` (`input`) and the older `/api/embeddings` (`prompt`, one text)."""

    model: Annotated[str, Meta(min_length=1)]
    input: str | list[str] | None = None
    prompt: str | None = None
    truncate: bool = True
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    options: OllamaOptions | None = None
    keep_alive: KeepAlive | None = None


class ModelRequest(msgspec.Struct, kw_only=True):
    """`/api/show`, `/api/delete` (`name` is the older spelling of `model`)."""

    model: str | None = None
    name: str | None = None
    verbose: bool = False

    @property
    def which(self) -> str:
        model = self.model or self.name
        if not model:
            raise APIError(400, "model is required", param="model")
        return model


class PullRequest(ModelRequest, kw_only=True):
    """`/api/pull`: `model` is a Hugging Face repo id, ORG/NAME[@REVISION]."""

    insecure: bool = False  # accepted, not used (the hub is always https)
    stream: bool = True


# The engine's chat field names (an error's `param`) as this API calls them.
PARAMS = (("response_format", "format"), ("max_tokens", "options.num_predict"),
          ("repetition_penalty", "options.repeat_penalty"), ("temperature", "options.temperature"),
          ("top_p", "options.top_p"), ("top_k", "options.top_k"), ("min_p", "options.min_p"),
          ("seed", "options.seed"), ("stop", "options.stop"), ("presence_penalty", "options.presence_penalty"),
          ("frequency_penalty", "options.frequency_penalty"), ("reasoning_effort", "think"),
          ("repetition_context_size", "options.repeat_last_n"))


# ---- keep_alive ----

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: KeepAlive | None) -> int | None:
    """`keep_alive` as whole seconds an idle engine stays (-1: for good; None: not given).

    A number is seconds; a string is a number of seconds or a Go duration ("5m", "1h30m",
    "90s"); a negative one keeps the model loaded, 0 unloads it once the request is done."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("+-")
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise APIError(400, f"keep_alive {value[:40]!r} is not a duration (such as 5m, 1h, 30s, -1 or 0).",
                               param="keep_alive") from None
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    else:
        seconds = float(value)
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise APIError(400, "keep_alive must be a finite duration.", param="keep_alive")
    if seconds < 0:
        return -1
    return min(int(seconds + 0.999), 2**31 - 1) if seconds > 0 else 0


# ---- requests ----


def _sampling(options: OllamaOptions | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if options is None:
        return out
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty"):
        if (value := getattr(options, name)) is not None:
            out[name] = value
    if options.repeat_penalty is not None:
        out["repetition_penalty"] = options.repeat_penalty
    if options.repeat_last_n == 0:  # Ollama's "no repeat penalty"
        out["repetition_penalty"] = 1.0
    elif options.repeat_last_n is not None:  # -1: the whole context (the longest window mlxd takes)
        out["repetition_context_size"] = options.repeat_last_n if options.repeat_last_n > 0 else 2**20
    if options.num_predict is not None:
        if options.num_predict == 0:
            raise APIError(400, "options.num_predict must be positive, or -1 for as much as the context holds.",
                           param="options.num_predict")
        if options.num_predict > 0:
            out["max_tokens"] = options.num_predict
    if options.stop:
        out["stop"] = [options.stop] if isinstance(options.stop, str) else options.stop
    return out


def _format(value: Format | None) -> dict[str, Any] | None:
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    assert isinstance(value, dict)
    return {"type": "json_schema", "json_schema": {"name": "format", "schema": value, "strict": True}}


def _think(body: dict[str, Any], think: Think | None) -> None:
    if think is None:
        return
    if isinstance(think, str):
        if think not in ("low", "medium", "high"):
            raise APIError(400, f"think must be true, false, \"low\", \"medium\" or \"high\", not {think!r}.",
                           param="think")
        body["reasoning_effort"] = think
    body["chat_template_kwargs"] = {"enable_thinking": think is not False}


_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
          (b"RIFF", "image/webp"), (b"BM", "image/bmp"))


def image_part(data: str, where: str) -> dict[str, Any]:
    """One of Ollama's images (base64, a data: URI tolerated) as an OpenAI `image_url` part."""
    if data.startswith("data:"):
        return {"type": "image_url", "image_url": {"url": data}}
    try:
        head = base64.b64decode(data[:64] + "=" * (-len(data[:64]) % 4), validate=False)[:8]
    except (binascii.Error, ValueError):
        head = b""
    mime = next((m for magic, m in _MAGIC if head.startswith(magic)), None)
    if mime is None:
        raise APIError(400, "An image must be base64 of a PNG, JPEG, GIF, WebP or BMP file.", param=where,
                       code="invalid_image")
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}}


def _content(text: str | None, images: list[str] | None, where: str) -> str | list[dict[str, Any]]:
    if not images:
        return text or ""
    parts = [image_part(img, f"{where}.images[{j}]") for j, img in enumerate(images)]
    return [*parts, {"type": "text", "text": text or ""}] if text else parts


def _arguments(args: dict[str, Any] | str) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def chat_messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's (tool calls' arguments as JSON text, each given an id that
    the `tool` answers after it refer to, in order)."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # ids of the calls not answered yet
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if msg.role == "tool":
            turn: dict[str, Any] = {"role": "tool", "content": msg.content or ""}
            if msg.tool_name:
                turn["name"] = msg.tool_name
            turn["tool_call_id"] = pending.pop(0) if pending else f"call_{i}"
            out.append(turn)
            continue
        turn = {"role": msg.role, "content": _content(msg.content, msg.images, where)}
        if msg.role == "assistant":
            if msg.thinking:
                turn["reasoning_content"] = msg.thinking
            if msg.tool_calls:
                calls = []
                for j, call in enumerate(msg.tool_calls):
                    call_id = call.id or f"call_{i}_{j}"
                    pending.append(call_id)
                    calls.append({"id": call_id, "type": "function", "function": {
                        "name": call.function.name, "arguments": _arguments(call.function.arguments)}})
                turn["tool_calls"] = calls
        elif msg.images and msg.role != "user":
            raise APIError(400, "Only user messages may hold images.", param=f"{where}.images")
        out.append(turn)
    return out


def chat_body(req: ChatRequest) -> dict[str, Any]:
    """The engine's OpenAI chat request for an Ollama chat (a 400 for what it cannot say)."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req.messages), **_sampling(req.options)}
    if req.tools:
        body["tools"] = req.tools
    if (fmt := _format(req.format)) is not None:
        body["response_format"] = fmt
    _think(body, req.think)
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def generate_body(req: GenerateRequest) -> tuple[bool, dict[str, Any]]:
    """(whether it is a raw text completion, the engine's request) for an Ollama generate."""
    if req.suffix:
        raise APIError(400, "suffix (fill-in-the-middle) is not supported.", param="suffix")
    if req.template:
        raise APIError(400, "template is not supported: mlxd renders prompts with the model's own chat template; "
                       "send raw: true with a prompt you rendered yourself.", param="template")
    body: dict[str, Any] = {"model": req.model, **_sampling(req.options)}
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if req.raw:
        if req.images:
            raise APIError(400, "images need the chat template: send them without raw.", param="images")
        if (fmt := _format(req.format)) is not None:
            body["response_format"] = fmt
        return True, {**body, "prompt": req.prompt}
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": req.system})
    messages.append({"role": "user", "content": _content(req.prompt, req.images, "prompt")})
    body["messages"] = messages
    if (fmt := _format(req.format)) is not None:
        body["response_format"] = fmt
    _think(body, req.think)
    return False, body


def embed_body(req: EmbedRequest, legacy: bool) -> dict[str, Any] | None:
    """The engine's OpenAI embeddings request for an Ollama embed (`legacy`: /api/embeddings);
    None when there is nothing to embed (the request only loads the model, as Ollama's does)."""
    texts = req.prompt if legacy else req.input
    if not texts:
        return None
    body: dict[str, Any] = {"model": req.model, "input": texts, "truncate": req.truncate, "encoding_format": "base64"}
    if req.dimensions is not None:
        body["dimensions"] = req.dimensions
    return body
