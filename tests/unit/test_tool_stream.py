"""tool_stream.py: tool calls out of a streamed reply with mlx-lm's parsers (and mlxd's Llama 3
one), whatever pieces the text arrives in; markup never leaks into content, and markup that
does not parse comes back as content."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from mlx_lm.tool_parsers import json_tools, mistral, pythonic, qwen3_coder

from mlxd.engine.chat.tool_stream import Call, Content, Markup, ToolCallStream
from mlxd.engine.chat.tools import _parse_llama3

HERMES = Markup(json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call)
MISTRAL = Markup(mistral.tool_call_start, mistral.tool_call_end, mistral.parse_tool_call)
QWEN3_CODER = Markup(qwen3_coder.tool_call_start, qwen3_coder.tool_call_end, qwen3_coder.parse_tool_call)
PYTHONIC = Markup(pythonic.tool_call_start, pythonic.tool_call_end, pythonic.parse_tool_call)
LLAMA3 = Markup("", "", _parse_llama3)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def run(markup: Markup, pieces: list[str], tools: Any = TOOLS, names: set[str] | None = None) -> tuple[str, list[Call]]:
    stream = ToolCallStream(markup, tools, tool_names=names)
    events = [e for p in pieces for e in stream.feed(p)] + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls = [e for e in events if isinstance(e, Call)]
    assert calls == stream.calls
    return content, calls


def splits(text: str, seed: int) -> list[list[str]]:
    """The whole text, one character at a time, and random cuts."""
    rng = random.Random(seed)
    out = [[text], list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


CASES = [
    ("hermes prose then call", HERMES,
     'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("hermes two calls", HERMES,
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "days": 2})]),
    ("mistral, runs to the end", MISTRAL, 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
     "Sure.", [("get_weather", {"city": "Paris"})]),
    ("qwen3-coder xml", QWEN3_CODER,
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n</function>\n</tool_call>", "", [("get_weather", {"city": "Paris", "days": 3})]),
    ("pythonic", PYTHONIC, '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>', "",
     [("get_weather", {"city": "Paris"})]),
    ("llama 3 bare json", LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    ("llama 3 two calls with ;", LLAMA3,
     '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", "parameters": {"city": "Rome"}}',
     "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    ("llama 3 prose", LLAMA3, "It is sunny {mostly} today.", "It is sunny {mostly} today.", []),
    ("llama 3 json that is no call", LLAMA3, '{"answer": 42}', '{"answer": 42}', []),
    ("hermes prose only, markers almost", HERMES, "a <tool or <tool_cal and <tool_callx> stay",
     "a <tool or <tool_cal and <tool_callx> stay", []),
    ("hermes bad json is content", HERMES, 'x <tool_call>{"name": "get_weather", "arguments": {</tool_call> y',
     'x <tool_call>{"name": "get_weather", "arguments": {</tool_call> y', []),
    ("hermes unclosed but whole call", HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {}}',
     "", [("get_weather", {})]),
    ("hermes unclosed and cut", HERMES, '<tool_call>\n{"name": "get_weather", "argu',
     '<tool_call>\n{"name": "get_weather", "argu', []),
    ("hermes call then prose", HERMES,
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n\nDone.',
     "Done.", [("get_weather", {"city": "Paris"})]),
]


@pytest.mark.parametrize(("markup", "text", "content", "calls"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_calls_and_content_come_out_the_same_whatever_the_pieces(
    markup: Markup, text: str, content: str, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    for i, pieces in enumerate(splits(text, seed=len(text))):
        got_content, got_calls = run(markup, pieces)
        assert got_content == content, f"split {i}: {pieces}"
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls, f"split {i}: {pieces}"
        assert [c.index for c in got_calls] == list(range(len(calls)))


def test_prose_streams_before_the_call_ends_and_markup_is_held_only_while_it_could_be_one() -> None:
    stream = ToolCallStream(HERMES, TOOLS)
    assert stream.feed("Checking the ") == [Content("Checking the")]  # trailing space waits
    assert stream.feed("weather <tool") == [Content(" weather")]  # "<tool" could start a call
    assert stream.feed('_call>{"name": "get_weather", ') == []
    assert stream.in_call
    events = stream.feed('"arguments": {"city": "Paris"}}</tool_call>')
    assert [type(e) for e in events] == [Call]
    assert stream.finish() == []


def test_whitespace_of_a_reply_without_calls_is_kept() -> None:
    assert run(HERMES, ["  two ", "words  \n"])[0] == "  two words  \n"


def test_a_call_to_a_function_not_offered_is_content() -> None:
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    content, calls = run(HERMES, [text], names={"get_weather"})
    assert (content, calls) == (text, [])


def test_the_models_own_call_id_is_kept_and_others_are_unique() -> None:
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "A"}, "id": "abc123XYZ"}]'
    _, calls = run(MISTRAL, [text])
    assert calls[0].id == "abc123XYZ"
    _, calls = run(HERMES, ['<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'] * 2)
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


def test_arguments_given_as_a_json_string_become_the_object_once() -> None:
    _, calls = run(HERMES, ['<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>'])
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
