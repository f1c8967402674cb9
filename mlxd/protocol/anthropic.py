"""Anthropic's Messages API, translated to and from the engine's OpenAI chat API.

The supervisor takes `POST /v1/messages` in Anthropic's shape, sends the engine the same
request as an OpenAI chat completion (`to_chat`), and turns the answer back: a whole
`chat.completion` with `from_chat`, a stream of `chat.completion.chunk` events with
`MessageStream`, which emits Anthropic's event sequence (`message_start`, then for each
content block `content_block_start`, its deltas and `content_block_stop`, then
`message_delta` with the stop reason and usage, and `message_stop`). Pure functions and
types: no I/O.

What maps to what:
  * `system` (a string or text blocks) is the system message, and `system` turns in
    `messages` are added to it;
  * a user message's `tool_result` blocks become `tool` messages (before its text); their
    content (a string or text blocks) is the tool's answer, prefixed `Error: ` when
    `is_error`; an assistant's `tool_use` blocks become `tool_calls` (the input as a JSON
    string) and its `thinking` blocks `reasoning_content`;
  * `tools` become function tools (`input_schema` is the parameters); server tools (those
    with a `type` other than `custom`) cannot run here and are left out;
  * `tool_choice` auto / any / tool / none is auto / required / the named function / none,
    and `disable_parallel_tool_use` is `parallel_tool_calls: false`;
  * `thinking` is the template's `enable_thinking` (false only for `disabled`);
    `output_config.effort` is `reasoning_effort`, `output_config.format` (a JSON schema) is
    `response_format`;
  * `stop_sequences` are `stop`; `top_k` passes as is; `metadata` is accepted and unused.
Image blocks (base64 or URL) become OpenAI `image_url` parts; document blocks are a 400. Unknown fields are ignored (clients
send beta fields such as `context_management`); an unknown block type is a 400.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from mlxd.protocol.errors import APIError

# ---- requests ----


class TextBlock(msgspec.Struct, tag="text", kw_only=True):
    text: str
    cache_control: Any = None
    citations: Any = None


class ImageBlock(msgspec.Struct, tag="image", kw_only=True):
    source: Any = None
    cache_control: Any = None


class DocumentBlock(msgspec.Struct, tag="document", kw_only=True):
    source: Any = None
    cache_control: Any = None


class ToolUseBlock(msgspec.Struct, tag="tool_use", kw_only=True):
    id: str
    name: str
    input: Any = None
    cache_control: Any = None


class ToolResultBlock(msgspec.Struct, tag="tool_result", kw_only=True):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    is_error: bool = False
    cache_control: Any = None


class ThinkingBlock(msgspec.Struct, tag="thinking", kw_only=True):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, tag="redacted_thinking", kw_only=True):
    data: str = ""


Block = TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class Message(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system"]  # Claude Code sends `system` turns too
    content: str | list[Block]


class Tool(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # None / "custom": a function; anything else is a server tool
    cache_control: Any = None


class ToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(msgspec.Struct, kw_only=True):
    type: Annotated[str, Meta(max_length=64)]  # enabled, disabled, adaptive, between_tools, ...
    budget_tokens: int | None = None
    display: str | None = None


class OutputFormat(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True):
    effort: Annotated[str, Meta(max_length=32)] | None = None
    format: OutputFormat | None = None


MaxTokens = Annotated[int, Meta(ge=1, le=2**31 - 1)]


class MessagesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: Annotated[list[Message], Meta(min_length=1)]
    max_tokens: MaxTokens
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[Annotated[str, Meta(max_length=512)]], Meta(max_length=16)] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None
    adapter: Annotated[str, Meta(max_length=1024)] | None = None  # mlxd's: the LoRA adapters it runs under
    speculation: bool | None = None  # mlxd's: false decodes without drafts


class CountTokensRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


# ---- answers (encoded as they are; the OpenAPI document is generated from them) ----

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicUsage(msgspec.Struct, omit_defaults=True):
    input_tokens: int  # prompt tokens computed
    output_tokens: int
    cache_read_input_tokens: int  # prompt tokens served from the prompt cache
    cache_creation_input_tokens: int
    speculation: dict[str, int] | None = None  # mlxd's: drafts checked and kept, where it drafted


class AnthropicMessage(msgspec.Struct):
    """A message: `content` holds `thinking`, `text` and `tool_use` blocks."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: StopReason
    stop_sequence: str | None
    usage: AnthropicUsage


class InputTokens(msgspec.Struct):
    input_tokens: int


class AnthropicErrorDetail(msgspec.Struct):
    type: str
    message: str


class AnthropicErrorBody(msgspec.Struct):
    """An error on the Anthropic routes, in Anthropic's shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class ModelCard(msgspec.Struct):
    type: Literal["model"]
    id: str
    display_name: str
    created_at: str  # RFC 3339


class ModelCardList(msgspec.Struct):
    """GET /v1/models for a caller that sends `anthropic-version`."""

    data: list[ModelCard]
    has_more: bool
    first_id: str | None
    last_id: str | None


def to_chat(req: MessagesRequest | CountTokensRequest, stream: bool = False) -> dict[str, Any]:
    """The engine's OpenAI chat request for an Anthropic one (a 400 for what it cannot say)."""
    messages: list[dict[str, Any]] = []
    # `system` and any system turns make one system message first: many chat templates take
    # a system message only there.
    system = [system_text(req.system)] + [system_text(message_text(m, i)) for i, m in enumerate(req.messages)
                                          if m.role == "system"]
    if text := "\n\n".join(s for s in system if s):
        messages.append({"role": "system", "content": text})
    for i, msg in enumerate(req.messages):
        if msg.role != "system":
            messages += chat_messages(msg, i)
    body: dict[str, Any] = {"messages": messages}
    if req.model is not None:
        body["model"] = req.model
    tools = [t for t in req.tools or [] if t.type in (None, "custom")]
    if tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description or "", "parameters": t.input_schema or {"type": "object"}}}
            for t in tools]
    if req.tool_choice is not None and (tools or req.tool_choice.type == "none"):
        body["tool_choice"] = chat_tool_choice(req.tool_choice, {t.name for t in tools})
        if req.tool_choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    if isinstance(req, MessagesRequest):
        if req.output_config is not None and req.output_config.effort is not None:
            body["reasoning_effort"] = req.output_config.effort
        if req.output_config is not None and req.output_config.format is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": req.output_config.format.schema, "strict": True}}
        body["max_tokens"] = req.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if (value := getattr(req, name)) is not None:
                body[name] = value
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
        if req.speculation is not None:
            body["speculation"] = req.speculation
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
    return body


def system_text(system: str | list[TextBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n\n".join(b.text for b in system)


def message_text(msg: Message, index: int) -> list[TextBlock] | str:
    """A system turn's text blocks (anything else in it is a 400)."""
    if isinstance(msg.content, str):
        return msg.content
    for j, block in enumerate(msg.content):
        if not isinstance(block, TextBlock):
            raise APIError(400, "A system message may hold only text blocks.", param=f"messages[{index}].content[{j}]")
    return [b for b in msg.content if isinstance(b, TextBlock)]


def chat_messages(msg: Message, index: int) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI chat messages (tool results are messages of their own)."""
    where = f"messages[{index}].content"
    if isinstance(msg.content, str):
        return [{"role": msg.role, "content": msg.content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    parts: list[dict[str, Any]] = []  # text and images in order, once the message holds an image
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for j, block in enumerate(msg.content):
        at = f"{where}[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            if msg.role != "user":
                raise APIError(400, "image blocks belong in user messages.", param=at)
            parts.append(image_part(block, at))
        elif isinstance(block, DocumentBlock):
            raise APIError(400, "document content blocks are not supported: this server has no document input.",
                           param=at)
        elif isinstance(block, ToolResultBlock):
            if msg.role != "user":
                raise APIError(400, "tool_result blocks belong in user messages.", param=at)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": tool_result_content(block, at)})
        elif isinstance(block, ToolUseBlock):
            if msg.role != "assistant":
                raise APIError(400, "tool_use blocks belong in assistant messages.", param=at)
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input or {})}})
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        # redacted_thinking: nothing a local model can read
    if msg.role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = "".join(thinking)
        if message["content"] is None and not calls:
            message["content"] = ""
        return [message]
    if any(p["type"] == "image_url" for p in parts):
        out.append({"role": "user", "content": parts})
    elif texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")


def first_image(req: MessagesRequest | CountTokensRequest) -> str | None:
    """Where the request's first image block is (`messages[i].content[j]`, in a tool result
    `...content[j].content[k]`), or None."""
    for i, msg in enumerate(req.messages):
        for j, block in enumerate(msg.content if isinstance(msg.content, list) else []):
            if isinstance(block, ImageBlock):
                return f"messages[{i}].content[{j}]"
            if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                for k, part in enumerate(block.content):
                    if isinstance(part, ImageBlock):
                        return f"messages[{i}].content[{j}].content[{k}]"
    return None


def image_part(block: ImageBlock, where: str) -> dict[str, Any]:
    """An image block as an OpenAI `image_url` part: base64 as a data: URI, a URL as it is (the
    supervisor fetches it)."""
    source = block.source if isinstance(block.source, dict) else {}
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in IMAGE_MEDIA_TYPES:
            raise APIError(400, f"An image's media_type must be one of {', '.join(IMAGE_MEDIA_TYPES)}.",
                           param=f"{where}.source.media_type")
        if not isinstance(data, str) or not data:
            raise APIError(400, "A base64 image source needs its data.", param=f"{where}.source.data")
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise APIError(400, "A url image source needs its url.", param=f"{where}.source.url")
        return {"type": "image_url", "image_url": {"url": url}}
    raise APIError(400, "An image block's source must be of type 'base64' or 'url'.", param=f"{where}.source")


def tool_result_content(block: ToolResultBlock, where: str) -> str | list[dict[str, Any]]:
    """A tool result's content: its text blocks joined by newlines, or (when it holds images) text
    and image parts in order; an error's starts with "Error: "."""
    if block.content is None or isinstance(block.content, str):
        parts: list[dict[str, Any]] = [{"type": "text", "text": block.content or ""}]
    else:
        parts = []
        for k, part in enumerate(block.content):
            if isinstance(part, TextBlock):
                if parts and parts[-1]["type"] == "text":
                    parts[-1]["text"] += "\n" + part.text
                else:
                    parts.append({"type": "text", "text": part.text})
            elif isinstance(part, ImageBlock):
                parts.append(image_part(part, f"{where}.content[{k}]"))
            else:
                raise APIError(400, "Only text and image blocks are supported in a tool_result's content.",
                               param=f"{where}.content[{k}]")
    if block.is_error:
        if parts and parts[0]["type"] == "text":
            parts[0]["text"] = "Error: " + parts[0]["text"]
        else:
            parts.insert(0, {"type": "text", "text": "Error: "})
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def chat_tool_choice(choice: ToolChoice, names: set[str]) -> Any:
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice of type 'tool' needs a 'name'.", param="tool_choice.name")
        if choice.name not in names:
            raise APIError(400, f"tool_choice names {choice.name!r}, which is not in tools.", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


# ---- responses ----


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> StopReason:
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "stop" and stop_sequence:
        return "stop_sequence"
    return "end_turn"


def usage_of(usage: dict[str, Any] | None) -> AnthropicUsage:
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    prompt = usage.get("prompt_tokens", 0) or 0
    return AnthropicUsage(input_tokens=prompt - cached, output_tokens=usage.get("completion_tokens", 0) or 0,
                          cache_read_input_tokens=cached, cache_creation_input_tokens=0,
                          speculation=usage.get("speculation"))


def from_chat(completion: dict[str, Any], model: str) -> AnthropicMessage:
    """An Anthropic message from the engine's whole chat completion."""
    choice = (completion.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id") or "toolu_" + uuid.uuid4().hex[:24],
                        "name": fn.get("name", ""), "input": parse_arguments(fn.get("arguments"))})
    stop = choice.get("stop_reason") if isinstance(choice.get("stop_reason"), str) else None
    reason = stop_reason(choice.get("finish_reason"), stop)
    return AnthropicMessage(new_message_id(), "message", "assistant", model=model, content=content,
                            stop_reason=reason, stop_sequence=stop if reason == "stop_sequence" else None,
                            usage=usage_of(completion.get("usage")))


def parse_arguments(arguments: Any) -> Any:
    """A call's arguments (a JSON string) as the `input` object; text that is not JSON stays a string."""
    if not isinstance(arguments, str):
        return arguments if arguments is not None else {}
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"_raw": arguments}


def sse(event: str, data: dict[str, Any] | msgspec.Struct) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


# ---- errors and models ----

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> AnthropicErrorBody:
    """Anthropic's error shape for an HTTP status."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return AnthropicErrorBody("error", AnthropicErrorDetail(kind, message))


def error_event(status: int, message: str) -> bytes:
    """An error in the middle of a stream."""
    return sse("error", error_body(status, message))


def model_card(model_id: str, created: float | None = None) -> ModelCard:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created or time.time()))
    return ModelCard("model", model_id, display_name=model_id, created_at=stamp)


def model_card_list(model_ids: list[str]) -> ModelCardList:
    """The model list in Anthropic's shape (one page: all of them)."""
    cards = [model_card(model_id) for model_id in model_ids]
    return ModelCardList(cards, has_more=False, first_id=cards[0].id if cards else None,
                         last_id=cards[-1].id if cards else None)
