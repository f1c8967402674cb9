"""OpenAI's Responses API, translated to and from the engine's OpenAI chat API.

The supervisor takes `POST /v1/responses`, prepends the stored turns a `previous_response_id`
names (their input and output, in order; not their `instructions`, per the spec), sends the
engine one chat request (`to_chat`), and turns the answer back into a Response object
(`response_from_chat`) or, streamed, into the Responses event sequence (`ResponseStream`),
each event with its `sequence_number`. Pure functions and types: no I/O.

Items in, chat messages out:
  * `message` (`type` may be left out): `system` and `developer` messages join `instructions`
    in one leading system message (most chat templates take one, first); `user` and
    `assistant` messages keep their place; content is a string or `input_text` /
    `output_text` parts, and a user message `input_image` parts (an `image_url`: a data: URI
    or an http(s) URL, which the supervisor fetches), which become chat `image_url` parts
    (`input_file` and `input_audio` are a 400);
  * `function_call` items are the assistant's `tool_calls` (consecutive ones in one turn),
    `function_call_output` items `tool` messages, `reasoning` items the next assistant
    turn's `reasoning_content`.
Tools: `function` tools, and the functions of a `namespace`; hosted tools (`web_search`,
`file_search`, `computer_use`, ...) cannot run here and are left out (the caller logs them).
Unknown fields are ignored (Codex sends `include`, `prompt_cache_key`, `client_metadata`).

The event names are OpenAI's (`response.reasoning_text.delta` where the Open Responses
specification of 2026-04-24 says `response.reasoning.delta`): OpenAI's SDK and Codex read them.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from mlxd.protocol.errors import APIError

INT32_MAX = 2**31 - 1


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]] = msgspec.field(default_factory=list)
    instructions: str | None = None
    previous_response_id: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    truncation: str | None = None
    user: str | None = None
    adapter: Annotated[str, Meta(max_length=1024)] | None = None  # mlxd's: the LoRA adapters it runs under
    speculation: bool | None = None  # mlxd's: false decodes without drafts


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- input ----


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items with ids and statuses, as they are stored and listed (a
    400 naming the item for one that cannot be read)."""
    if isinstance(req.input, str):
        return [{"type": "message", "id": new_id("msg"), "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": req.input}]}]
    return [normal_item(item, f"input[{i}]") for i, item in enumerate(req.input)]


def first_image(items: list[dict[str, Any]]) -> str | None:
    """Where this request's first input_image part is (`input[i].content[j]`), or None."""
    for i, item in enumerate(items):
        for j, part in enumerate(item.get("content") or [] if item["type"] == "message" else []):
            if part.get("type") == "input_image":
                return f"input[{i}].content[{j}]"
    return None


ROLES = ("user", "assistant", "system", "developer")


def normal_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise APIError(400, f"A message's role must be one of {', '.join(ROLES)}.", param=f"{where}.role")
        content = item.get("content")
        part_type = "output_text" if role == "assistant" else "input_text"
        if isinstance(content, str):
            parts = [{"type": part_type, "text": content}]
        elif isinstance(content, list):
            parts = [normal_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
        else:
            raise APIError(400, "A message's content must be a string or a list of parts.", param=f"{where}.content")
        out = {"type": "message", "id": item.get("id") or new_id("msg"), "role": role, "status": "completed",
               "content": parts}
        return out
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise APIError(400, f"A function_call item needs a string '{key}'.", param=f"{where}.{key}")
        return {"type": "function_call", "id": item.get("id") or new_id("fc"), "call_id": item["call_id"],
                "name": item["name"], "arguments": item["arguments"], "status": "completed"}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise APIError(400, "A function_call_output item needs a string 'call_id'.", param=f"{where}.call_id")
        output = item.get("output")
        if isinstance(output, list):
            output = "".join(p.get("text", "") for p in output if isinstance(p, dict) and p.get("type") in (
                "input_text", "output_text", "text"))
        if not isinstance(output, str):
            raise APIError(400, "A function_call_output item needs an 'output' string.", param=f"{where}.output")
        return {"type": "function_call_output", "id": item.get("id") or new_id("fco"), "call_id": item["call_id"],
                "output": output, "status": "completed"}
    if kind == "reasoning":
        text = "".join(p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict))
        if not text:
            text = "".join(p.get("text", "") for p in item.get("summary") or [] if isinstance(p, dict))
        return {"type": "reasoning", "id": item.get("id") or new_id("rs"), "summary": item.get("summary") or [],
                "content": [{"type": "reasoning_text", "text": text}] if text else []}
    if kind == "compaction":
        content = item.get("encrypted_content")
        if not isinstance(content, str) or compaction_summary(content) is None:
            raise APIError(400, "A compaction item's encrypted_content must be one /v1/responses/compact of this "
                                "server made (another server's cannot be read here).",
                           param=f"{where}.encrypted_content")
        return {"type": "compaction", "id": item.get("id") or new_id("cmp"), "encrypted_content": content}
    raise APIError(400, f"Input items of type {kind!r} are not supported (message, function_call, "
                        "function_call_output, reasoning, compaction).", param=f"{where}.type")


COMPACTION_PREFIX = "mlxd-compaction-v1:"  # mlxd's compaction items: this, then the summary in base64


def compaction_item(summary: str) -> dict[str, Any]:
    """A compaction item carrying `summary` (POST /v1/responses/compact's; not encrypted: mlxd
    runs on the caller's machine, and the caller may read it)."""
    encoded = base64.b64encode(summary.encode()).decode()
    return {"type": "compaction", "id": new_id("cmp"), "encrypted_content": COMPACTION_PREFIX + encoded}


def compaction_summary(content: str) -> str | None:
    """The summary in a compaction item's content (None: not one of mlxd's)."""
    if not content.startswith(COMPACTION_PREFIX):
        return None
    try:
        return base64.b64decode(content[len(COMPACTION_PREFIX):], validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return None


def normal_part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
        return {"type": kind if kind != "text" else "input_text", "text": part["text"]}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            what = "file_id images are not supported (no file store)" if part.get("file_id") else "it needs one"
            raise APIError(400, f"An input_image part takes its image as image_url: {what}.", param=f"{where}.image_url")
        return {"type": "input_image", "image_url": url}
    if kind in ("input_file", "input_audio", "input_video"):
        raise APIError(400, f"{kind} parts are not supported: this server has no file, audio or video input here.",
                       param=where)
    raise APIError(400, "A content part must be input_text or output_text with a string 'text'.", param=where)


COMPACTED = "A summary of the conversation before this point (it was compacted):\n\n"


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]], items: list[dict[str, Any]],
            stream: bool = False) -> dict[str, Any]:
    """The engine's chat request: `history` (the stored turns' items, in order) and this
    request's `items`, with its own settings."""
    system = [req.instructions] if req.instructions else []
    messages: list[dict[str, Any]] = []
    reasoning = ""
    for item in [*history, *items]:
        kind = item["type"]
        if kind == "message":
            if any(p["type"] == "input_image" for p in item["content"]):
                if item["role"] != "user":
                    raise APIError(400, "input_image parts belong in user messages.", param="input")
                messages.append({"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": p["image_url"]}} if p["type"] == "input_image"
                    else {"type": "text", "text": p["text"]} for p in item["content"]]})
                continue
            text = "".join(p["text"] for p in item["content"])
            if item["role"] in ("system", "developer"):
                system.append(text)
            elif item["role"] == "assistant":
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if reasoning:
                    message["reasoning_content"], reasoning = reasoning, ""
                messages.append(message)
            else:
                messages.append({"role": "user", "content": text})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    message["reasoning_content"], reasoning = reasoning, ""
                messages.append(message)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind == "reasoning":
            reasoning += "".join(p.get("text", "") for p in item.get("content") or [])
        elif kind == "compaction":
            system.append(COMPACTED + (compaction_summary(item["encrypted_content"]) or ""))
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    if not any(m["role"] != "system" for m in messages):
        raise APIError(400, "The input holds no message to answer.", param="input")
    body: dict[str, Any] = {"messages": messages}
    if req.model is not None:
        body["model"] = req.model
    tools, _ = function_tools(req.tools or [])
    if tools:
        body["tools"] = chat_tools(tools)
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice, tools)
        if isinstance(req.tool_choice, dict) and req.tool_choice.get("type") == "allowed_tools":
            allowed = {t.get("name") for t in req.tool_choice.get("tools") or [] if isinstance(t, dict)}
            body["tools"] = chat_tools([t for t in tools if t["function"]["name"] in allowed])
    if req.parallel_tool_calls is not None and tools:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if (fmt := chat_format(req.text)) is not None:
        body["response_format"] = fmt
    if req.reasoning is not None:  # asked for: a template that can think does (effort "none": it does not)
        effort = req.reasoning.get("effort")
        body["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
        if isinstance(effort, str):
            body["reasoning_effort"] = effort
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
                         ("speculation", "speculation")):
        if (value := getattr(req, ours)) is not None:
            body[theirs] = value
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def function_tools(tools: list[dict[str, Any]], namespace: str | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Chat function tools from Responses tools (a namespace's functions included, each
    marked with its namespace), and the types left out (hosted tools)."""
    out: list[dict[str, Any]] = []
    dropped: list[str] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind == "function":
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise APIError(400, "A function tool needs a 'name'.", param=f"tools[{i}].name")
            out.append({"type": "function", "function": {
                "name": tool["name"], "description": tool.get("description") or "",
                "parameters": tool.get("parameters") or {"type": "object", "properties": {}}},
                **({"namespace": namespace} if namespace else {})})
        elif kind == "namespace":
            inner, more = function_tools([t for t in tool.get("tools") or [] if isinstance(t, dict)],
                                         str(tool.get("name") or ""))
            out += inner
            dropped += more
        else:
            dropped.append(str(kind))
    return out, dropped


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools as the engine takes them (without mlxd's namespace mark)."""
    return [{"type": "function", "function": t["function"]} for t in tools]


def chat_tool_choice(choice: str | dict[str, Any], tools: list[dict[str, Any]]) -> Any:
    names = {t["function"]["name"] for t in tools}
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise APIError(400, "tool_choice must be auto, none, required or an object.", param="tool_choice")
        return choice if tools or choice == "none" else "none"
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if name not in names:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the function tools.",
                           param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    if kind == "allowed_tools":
        return "required" if choice.get("mode") == "required" else "auto"
    return "auto"  # a hosted tool's choice: nothing here can run it


def chat_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output",
                                                       "schema": fmt.get("schema") or {}, "strict": fmt.get("strict")}}
    raise APIError(400, f"text.format type {fmt['type']!r} is not supported (text, json_object, json_schema).",
                   param="text.format.type")


# ---- output ----


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "status": "completed", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or new_id("fc"), "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def usage_of(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    prompt, completion = usage.get("prompt_tokens", 0) or 0, usage.get("completion_tokens", 0) or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    out = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
           "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
           "total_tokens": prompt + completion}
    if usage.get("speculation"):
        out["speculation"] = usage["speculation"]  # mlxd's: drafts checked and kept
    return out


class ResponseObject(msgspec.Struct, forbid_unknown_fields=True):
    """A Response (OpenAI's Responses API): `output` holds reasoning, message and
    function_call items; the request's settings are echoed."""

    # The schema of what Shell.response builds, field for field and in its order (pinned by
    # tests/unit/test_responses_protocol.py). The answer itself stays a dict: the stream updates
    # it as it goes, and the store keeps it and replays it as it is.
    id: str
    object: Literal["response"]
    created_at: int
    completed_at: int | None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    incomplete_details: dict[str, Any] | None
    model: str
    previous_response_id: str | None
    instructions: str | None
    output: list[dict[str, Any]]
    error: dict[str, Any] | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    truncation: str
    parallel_tool_calls: bool
    text: dict[str, Any]
    top_p: float
    presence_penalty: float
    frequency_penalty: float
    top_logprobs: int
    temperature: float
    reasoning: dict[str, Any] | None
    usage: dict[str, Any] | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    store: bool
    background: bool
    service_tier: str
    metadata: dict[str, Any]
    safety_identifier: str | None
    prompt_cache_key: str | None
    user: str | None


class Shell:
    """What a Response object repeats from its request, and its id."""

    def __init__(self, req: ResponsesRequest, model: str, response_id: str | None = None) -> None:
        self.req = req
        self.model = model
        self.id = response_id or new_id("resp")
        self.created_at = int(time.time())
        tools, self.dropped = function_tools(req.tools or [])  # dropped: the hosted tools' types
        # a namespace's function, called, says its namespace (Codex groups MCP tools so)
        self.namespaces = {t["function"]["name"]: t["namespace"] for t in tools if "namespace" in t}
        self.tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
                       "parameters": t["function"]["parameters"], "strict": None} for t in tools]  # as echoed

    def call(self, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
        item = call_item(call_id, name, arguments, status)
        if name in self.namespaces:
            item["namespace"] = self.namespaces[name]
        return item

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None, incomplete: str | None = None) -> dict[str, Any]:
        req = self.req
        fmt = (req.text or {}).get("format") or {"type": "text"}
        done = status in ("completed", "incomplete", "failed")
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "completed_at": int(time.time()) if done else None, "status": status,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "model": self.model, "previous_response_id": req.previous_response_id,
            "instructions": req.instructions, "output": output, "error": error, "tools": self.tools,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "truncation": req.truncation or "disabled",
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "text": {"format": fmt}, "top_p": req.top_p if req.top_p is not None else 1.0,
            "presence_penalty": req.presence_penalty or 0.0, "frequency_penalty": req.frequency_penalty or 0.0,
            "top_logprobs": 0, "temperature": req.temperature if req.temperature is not None else 1.0,
            "reasoning": req.reasoning, "usage": usage, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None, "store": req.store, "background": False, "service_tier": "default",
            "metadata": req.metadata or {}, "safety_identifier": None, "prompt_cache_key": None, "user": req.user,
        }


def response_from_chat(shell: Shell, completion: dict[str, Any]) -> dict[str, Any]:
    """The Response object for the engine's whole chat completion."""
    choice = (completion.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        output.append(reasoning_item(msg["reasoning_content"]))
    if msg.get("content") or not msg.get("tool_calls"):
        output.append(message_item(msg.get("content") or ""))
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        output.append(shell.call(call.get("id") or new_id("call"), fn.get("name", ""), fn.get("arguments") or "{}"))
    incomplete = choice.get("finish_reason") == "length"
    if incomplete and output:
        output[-1]["status"] = "incomplete"
    return shell.response("incomplete" if incomplete else "completed", output, usage_of(completion.get("usage")),
                          incomplete="max_output_tokens" if incomplete else None)


def sse(data: dict[str, Any]) -> bytes:
    """One event, in one piece (`event:` equal to its type, the JSON on one `data:` line)."""
    return b"event: " + data["type"].encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


DONE = b"data: [DONE]\n\n"
