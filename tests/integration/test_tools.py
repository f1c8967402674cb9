"""Tool calls on the chat API through a real supervisor and a real SmolLM2 engine, with the
official openai SDK: forced calls (SmolLM2 will not call on its own), the round trip with the
result, streaming in OpenAI's shape (and the SDK's own stream helper), and every malformed
tool, tool_choice and earlier call answered with a 400 naming it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support import SupervisorProcess, serving

MODEL = "smol"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def sup(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    with serving(smollm2, MODEL, tmp_path_factory.mktemp("tools")) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(sup: SupervisorProcess) -> openai.OpenAI:
    return sup.openai()


def create(client: openai.OpenAI, **kw: Any) -> Any:
    args = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 60, **kw}
    return client.chat.completions.create(**args)


def test_a_named_tool_choice_gets_a_call_with_json_arguments(client: openai.OpenAI) -> None:
    out = create(client, tools=[WEATHER], tool_choice=NAMED)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # held to the function's schema
    assert choice.message.content is None  # the call ends the reply: nothing after it


def test_required_with_two_tools_gets_a_call_to_one_of_them_with_its_schema(client: openai.OpenAI) -> None:
    clock = {"type": "function", "function": {"name": "get_time", "description": "The time now in a city.",
                                              "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                             "required": ["tz"], "additionalProperties": False}}}
    out = create(client, tools=[WEATHER, clock], tool_choice="required")
    (call,) = out.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert (call.function.name, sorted(args)) in [("get_weather", ["city"]), ("get_time", ["tz"])]
    assert out.choices[0].finish_reason == "tool_calls"


def test_the_call_and_its_result_go_back_and_the_model_answers_in_text(client: openai.OpenAI) -> None:
    first = create(client, tools=[WEATHER], tool_choice=NAMED).choices[0].message
    call = first.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    out = create(client, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=40)
    choice = out.choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    # the call and its result were in the prompt: it is longer than the question alone by them
    alone = create(client, tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert out.usage.prompt_tokens > alone.usage.prompt_tokens + 20


def test_a_streamed_call_comes_in_openais_shape(client: openai.OpenAI) -> None:
    chunks = list(create(client, tools=[WEATHER], tool_choice="required", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [d.tool_calls for d in deltas if d.tool_calls]
    assert calls, "no tool_calls delta"
    opening = calls[0][0]
    assert (opening.index, opening.type, opening.function.name) == (0, "function", "get_weather")
    assert opening.id and opening.function.arguments == ""
    arguments = "".join(c[0].function.arguments or "" for c in calls[1:] if c[0].index == 0)
    assert json.loads(arguments) == {"city": "Paris"}
    assert all(c[0].id is None for c in calls[1:])  # the id comes once
    assert "".join(d.content or "" for d in deltas) == ""  # no markup leaked, and the call ends the reply
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_sdks_stream_helper_assembles_the_call(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(model=MODEL, messages=ASK, temperature=0, max_tokens=60,  # type: ignore[arg-type]
                                        tools=[WEATHER], tool_choice=NAMED) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)
    assert final.choices[0].finish_reason == "tool_calls"


def test_without_tools_nothing_changes(client: openai.OpenAI) -> None:
    out = create(client, max_tokens=12)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("tools not a list", {"tools": {"type": "function"}}, "tools"),
    ("tool of another type", {"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ("no function object", {"tools": [{"type": "function"}]}, "tools[0].function"),
    ("name with a space", {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
    ("name too long", {"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ("two tools one name", {"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ("parameters not an object", {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    ("tool_choice unknown word", {"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ("tool_choice names another", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ("tool_choice without a name", {"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("earlier call with bad arguments", {"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("earlier call without a name", {"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"arguments": "{}"}}]}]}, "messages[1].tool_calls[0].function.name"),
    ("tool result without its call id", {"messages": [*ASK, {"role": "tool", "content": "21C"}]},
     "messages[1].tool_call_id"),
]


@pytest.mark.parametrize(("body", "param"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_tools_get_a_400_naming_the_field(sup: SupervisorProcess, body: dict[str, Any], param: str) -> None:
    resp = sup.client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error" and error["message"]
