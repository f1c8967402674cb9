"""Tools on the chat API: which markup a model calls tools with, the request's checks, how
tools and earlier calls reach the chat template, and how `tool_choice` is honoured.

The format is mlx-lm's for the model (`TokenizerWrapper.tool_parser`, chosen from the chat
template and vocabulary as mlx-lm does: Hermes/Qwen JSON in `<tool_call>` tags, Qwen3-coder
XML, Mistral, pythonic, Gemma, GLM, Kimi, MiniMax and the rest). Two more are mlxd's:

- **Llama 3** (`llama3_json`): the template asks for a bare JSON object
  `{"name": ..., "parameters": ...}` as the whole reply; a reply that opens with `{` is held
  until it ends and is a call if it parses as one.
- **Hermes fallback** (`hermes_fallback`): a template that ignores `tools` (SmolLM2's, many
  small models') gets the tools in a system message, with the Hermes `<tool_call>` format
  described, and earlier calls and results written into the messages in that format.

`tool_choice`: `none` renders no tools and parses no calls; `auto` (the default) lets the
model choose; `required` and a named function put the start of a call at the end of the
prompt, so the reply is a call (formats whose markup allows it: the Hermes/Qwen JSON, Llama 3
and, for `required`, any with a start marker).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from mlxd.engine.chat.tool_stream import Markup
from mlxd.protocol.errors import APIError

NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    markup: Markup
    in_template: bool  # the chat template renders tools itself (else mlxd writes them in)

    def forced(self, function: str | None) -> str | None:
        """Text that, put after the prompt, makes the reply a call (to `function` if given);
        None where this format cannot be steered that way."""
        start = self.markup.start
        if self.name in ("json_tools", "hermes_fallback"):
            return f'{start}\n{{"name": {json.dumps(function)}, "arguments": ' if function else f'{start}\n{{"name": "'
        if self.name == "llama3_json":
            return f'{{"name": {json.dumps(function)}, "parameters": ' if function else '{"name": "'
        if function is None and start:
            return start
        return None


# --- formats ----------------------------------------------------------------------------------


def _parse_json(text: str, _tools: Any = None) -> Any:
    return json.loads(text.strip())


def _parse_llama3(text: str, _tools: Any = None) -> Any:
    """One JSON call, a list of them, or several one after another (Llama 3.1 separates
    them with ';' or nothing)."""
    decoder = json.JSONDecoder()
    text = text.strip()
    calls: list[Any] = []
    pos = 0
    while pos < len(text):
        value, pos = decoder.raw_decode(text, pos)
        calls.extend(value if isinstance(value, list) else [value])
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
    if not calls:
        raise ValueError("no call")
    return calls


def format_of(tokenizer: Any, takes_tools: bool) -> ToolFormat:
    """The tool format of a model (`tokenizer`: mlx-lm's TokenizerWrapper); `takes_tools`:
    whether its chat template renders the `tools` it is given."""
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else ""
    if takes_tools and getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_parser is not None:
        name = getattr(tokenizer.tool_parser, "__module__", "").rsplit(".", 1)[-1] or "mlx_lm"
        return ToolFormat(name, Markup(tokenizer.tool_call_start, tokenizer.tool_call_end or "", tokenizer.tool_parser),
                          True)
    if takes_tools and ("<|python_tag|>" in template or '"parameters": dictionary of argument name' in template):
        return ToolFormat("llama3_json", Markup("", "", _parse_llama3), True)
    if takes_tools and HERMES_START in template:  # a template that writes Hermes tags mlx-lm did not place
        return ToolFormat("json_tools", Markup(HERMES_START, HERMES_END, _parse_json), True)
    return ToolFormat("hermes_fallback", Markup(HERMES_START, HERMES_END, _parse_json), False)


PROBE_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "mlxd_probe_tool_7f3a", "description": "probe", "parameters": {"type": "object", "properties": {}}}}


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the chat template writes the `tools` it is given into the prompt."""
    if not getattr(tokenizer, "has_chat_template", False):
        return False
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[PROBE_TOOL],
                                             add_generation_prompt=True, tokenize=False)
    except Exception:  # a template that chokes on tools does not take them
        return False
    return PROBE_TOOL["function"]["name"] in str(text)


# --- request checks ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # as sent (OpenAI's shape), checked
    names: set[str]
    choice: str  # "none" | "auto" | "required" | "function"
    function: str | None  # the named function of tool_choice
    parallel: bool

    @property
    def forced_function(self) -> str | None:
        """The function a forced call is to: the named one, or for `required` the only tool."""
        return self.function or (next(iter(self.names)) if len(self.names) == 1 else None)


def check_tools(tools: Any, tool_choice: Any, parallel: bool | None) -> ToolRequest | None:
    """The request's tools and tool_choice, checked (a 400 naming the field); None when the
    request has no tools or turns them off."""
    if tools is not None and not isinstance(tools, list):
        raise APIError(400, "tools must be a list of function tools.", param="tools")
    tools = tools or []
    names: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(400, "Each tool must be an object with type 'function'.", param=where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise APIError(400, "A function tool needs a 'function' object.", param=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise APIError(400, "A function name must be 1 to 64 letters, digits, '_', '-' or '.'.",
                           param=f"{where}.function.name")
        if name in names:
            raise APIError(400, f"Two tools are named {name!r}.", param=f"{where}.function.name")
        names.append(name)
        if "description" in fn and not isinstance(fn["description"], str | type(None)):
            raise APIError(400, "A function description must be a string.", param=f"{where}.function.description")
        if "parameters" in fn and not isinstance(fn["parameters"], dict | type(None)):
            raise APIError(400, "Function parameters must be a JSON Schema object.",
                           param=f"{where}.function.parameters")
    choice, function = _choice(tool_choice, names)
    if not tools or choice == "none":
        return None
    return ToolRequest(tools, set(names), choice, function, parallel is not False)


def _choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not names:
            raise APIError(400, "tool_choice 'required' needs tools.", param="tool_choice")
        return str(tool_choice), None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise APIError(400, "tool_choice needs function.name.", param="tool_choice.function.name")
        if name not in names:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools.",
                           param="tool_choice.function.name")
        return "function", name
    raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}.", param="tool_choice")


# --- messages for the template ----------------------------------------------------------------


def template_messages(messages: list[dict[str, Any]], fmt: ToolFormat | None,
                      tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: earlier calls' arguments as objects (what
    templates index into), or, for a template that ignores tools, calls and results written
    in Hermes markup and the tools in a system message. Malformed calls are a 400."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls") is not None:
            calls = _checked_calls(m["tool_calls"], i)
            if fmt is not None and not fmt.in_template:
                text = "\n".join(f"{HERMES_START}\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n"
                                 f"{HERMES_END}" for n, a, _ in calls)
                m["content"] = ((m.get("content") or "") + ("\n" if m.get("content") else "") + text)
                del m["tool_calls"]
            else:
                m["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": n, "arguments": a}}
                                   for n, a, cid in calls]
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise APIError(400, "A tool message needs the tool_call_id it answers.",
                               param=f"messages[{i}].tool_call_id")
            if fmt is not None and not fmt.in_template:
                content = m.get("content") or ""
                if isinstance(content, list):  # with images: the markup around its parts
                    m["content"] = [{"type": "text", "text": "<tool_response>\n"}, *content,
                                    {"type": "text", "text": "\n</tool_response>"}]
                else:
                    m["content"] = f"<tool_response>\n{content}\n</tool_response>"
        out.append(m)
    if fmt is not None and not fmt.in_template and tools:
        out = _with_tool_system_prompt(out, tools)
    return out


def _checked_calls(calls: Any, i: int) -> list[tuple[str, dict[str, Any], str]]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise APIError(400, "tool_calls must be a list.", param=where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, "A tool call needs function.name.", param=f"{where}[{j}].function.name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as exc:
                raise APIError(400, f"A tool call's arguments must be a JSON object in a string: {exc}.",
                               param=f"{where}[{j}].function.arguments") from exc
        if not isinstance(args, dict):
            raise APIError(400, "A tool call's arguments must be a JSON object.", param=f"{where}[{j}].function.arguments")
        cid = call.get("id") if isinstance(call.get("id"), str) else f"call_{i}_{j}"
        out.append((fn["name"], args, cid))
    return out


def _with_tool_system_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    text = (
        "You can call functions. The available functions, one JSON object each:\n<tools>\n"
        f"{listing}\n</tools>\n\n"
        "To call a function, reply with a JSON object holding its name and arguments inside tags:\n"
        f'{HERMES_START}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n{HERMES_END}\n'
        "A function's result comes back in <tool_response></tool_response> tags."
    )
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{text}".strip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
