"""protocol/responses.py: Responses requests (and stored turns) to the engine's chat requests,
chat answers back to Response objects, and the streamed event sequence, checked against the
rules the Open Responses specification sets for a stream."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from mlxd.protocol import responses as rs
from mlxd.protocol.chat_chunks import ChatChunk, chunk_decoder
from mlxd.protocol.errors import APIError
from mlxd.protocol.responses_stream import ResponseStream, replay

WEATHER = {"type": "function", "name": "get_weather", "description": "d",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(**kw: Any) -> rs.ResponsesRequest:
    return msgspec.json.decode(json.dumps({"model": "m", "input": "hi", **kw}), type=rs.ResponsesRequest)


def chat_of(req: rs.ResponsesRequest, history: list[dict[str, Any]] | None = None, stream: bool = False) -> dict[str, Any]:
    return rs.to_chat(req, history or [], rs.input_items(req), stream)


def test_a_string_input_is_one_user_message() -> None:
    chat = chat_of(request(instructions="Be brief.", max_output_tokens=50, temperature=0.1), stream=True)
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert chat["max_tokens"] == 50 and chat["temperature"] == 0.1
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}


def test_items_become_messages_calls_and_tool_results() -> None:
    req = request(input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "sun"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Rain and sun."}]},
        {"role": "system", "content": "Answer in English."},
    ], tools=[WEATHER], tool_choice="required", parallel_tool_calls=True)
    chat = chat_of(req)
    assert chat["messages"] == [
        {"role": "system", "content": "Use tools.\n\nAnswer in English."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "Call it.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "sun"},
        {"role": "assistant", "content": "Rain and sun."},
    ]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is True


def test_history_comes_first_and_instructions_are_this_requests_own() -> None:
    first = rs.input_items(request(input="My name is Ann."))
    said = [rs.message_item("Hello Ann.")]
    chat = chat_of(request(input="Who am I?", instructions="Be kind."), history=[*first, *said])
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "user"]
    assert chat["messages"][0]["content"] == "Be kind."


def test_tools_namespaces_hosted_tools_and_choices() -> None:
    tools = [WEATHER, {"type": "namespace", "name": "mcp__files", "tools": [
        {"type": "function", "name": "read_file", "parameters": {"type": "object"}}]},
        {"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["v"]}]
    found, dropped = rs.function_tools(tools)
    assert [t["function"]["name"] for t in found] == ["get_weather", "read_file"]
    assert found[1]["namespace"] == "mcp__files" and dropped == ["web_search", "file_search"]
    chat = chat_of(request(tools=tools, tool_choice={"type": "function", "name": "read_file"}))
    assert all(set(t) == {"type", "function"} for t in chat["tools"])  # no namespace mark for the engine
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "read_file"}}
    allowed = chat_of(request(tools=tools, tool_choice={"type": "allowed_tools", "mode": "required",
                                                        "tools": [{"type": "function", "name": "get_weather"}]}))
    assert [t["function"]["name"] for t in allowed["tools"]] == ["get_weather"] and allowed["tool_choice"] == "required"
    shell = rs.Shell(request(tools=tools), "m")
    assert shell.call("c", "read_file", "{}")["namespace"] == "mcp__files"
    assert "namespace" not in shell.call("c", "get_weather", "{}")


def test_text_format_and_reasoning_effort() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = chat_of(request(text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}},
                           reasoning={"effort": "low"}))
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert chat["reasoning_effort"] == "low" and chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert chat_of(request(reasoning={"effort": "none"}))["chat_template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_kwargs" not in chat_of(request())  # the model's own default
    assert "response_format" not in chat_of(request(text={"format": {"type": "text"}}))


def test_input_image_parts_become_image_url_parts_in_order() -> None:
    content = [{"type": "input_text", "text": "What is "}, {"type": "input_image", "image_url": "data:image/png;base64,AA==",
                                                            "detail": "auto"},
               {"type": "input_image", "image_url": "https://example.com/b.png"}]
    chat = chat_of(request(input=[{"role": "user", "content": content}]))
    assert chat["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "What is "}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
        {"type": "image_url", "image_url": {"url": "https://example.com/b.png"}}]}]


@pytest.mark.parametrize(("input_", "param"), [
    ([{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}], "input[0].content[0].image_url"),
    ([{"role": "user", "content": [{"type": "input_file", "file_data": "AA=="}]}], "input[0].content[0]"),
    ([{"role": "system", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}], "input"),
    ([{"role": "robot", "content": "x"}], "input[0].role"),
    ([{"type": "item_reference", "id": "x"}], "input[0].type"),
    ([{"type": "function_call", "call_id": "c", "name": "f"}], "input[0].arguments"),
    ([{"role": "user", "content": 5}], "input[0].content"),
])
def test_what_cannot_be_read_is_a_400_naming_it(input_: list[dict[str, Any]], param: str) -> None:
    with pytest.raises(APIError) as info:
        chat_of(request(input=input_))
    assert info.value.status == 400 and info.value.param == param


def test_a_tool_choice_naming_no_function_and_a_bad_format_are_400s() -> None:
    with pytest.raises(APIError) as info:
        chat_of(request(tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}))
    assert info.value.param == "tool_choice.name"
    with pytest.raises(APIError) as info:
        chat_of(request(text={"format": {"type": "yaml"}}))
    assert info.value.param == "text.format.type"


def test_a_whole_answer_becomes_a_response_with_every_key() -> None:
    shell = rs.Shell(request(tools=[WEATHER], metadata={"k": "v"}), "m")
    completion = {"choices": [{"finish_reason": "tool_calls", "message": {
        "content": "Checking.", "reasoning_content": "hm",
        "tool_calls": [{"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 8}}}
    resp = rs.response_from_chat(shell, completion)
    assert resp["status"] == "completed" and resp["object"] == "response" and isinstance(resp["created_at"], int)
    assert [o["type"] for o in resp["output"]] == ["reasoning", "message", "function_call"]
    assert resp["output"][2]["call_id"] == "call_1" and resp["output"][2]["status"] == "completed"
    assert resp["usage"] == {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 8}, "output_tokens": 5,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 25}
    assert resp["tools"] == [{"type": "function", "name": "get_weather", "description": "d",
                              "parameters": WEATHER["parameters"], "strict": None}]
    assert resp["metadata"] == {"k": "v"} and resp["error"] is None
    cut = rs.response_from_chat(shell, {"choices": [{"finish_reason": "length", "message": {"content": "ab"}}]})
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][-1]["status"] == "incomplete"


@pytest.mark.parametrize("status", ["in_progress", "completed", "incomplete", "failed"])
def test_a_response_is_the_struct_the_document_names_field_for_field(status: str) -> None:
    req = request(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, reasoning={"effort": "low"},
                  temperature=0.5, max_output_tokens=9, user="u", instructions="be brief")
    built = rs.Shell(req, "m").response(status, [rs.message_item("hi")], error={"code": "x", "message": "y"},
                                        incomplete="max_output_tokens" if status == "incomplete" else None)
    assert list(built) == list(rs.ResponseObject.__struct_fields__)  # every key, in its order, and no other
    decoded = msgspec.json.decode(msgspec.json.encode(built), type=rs.ResponseObject)  # and every type as described
    assert msgspec.to_builtins(decoded) == built


def parse(data: bytes) -> list[dict[str, Any]]:
    """The events of a stream, checked as the Open Responses rules say: one `data:` line each,
    `event:` equal to `type`, sequence numbers counting up from 0, nothing after the terminal
    event but [DONE]; items and parts added before their deltas and done once."""
    blocks = [b for b in data.decode().split("\n\n") if b]
    assert blocks[-1] == "data: [DONE]"
    events = []
    for block in blocks[:-1]:
        name, payload = block.split("\n")
        event = json.loads(payload.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
    assert all(e["type"] not in ("response.completed", "response.incomplete", "response.failed") for e in events[:-1])
    added, done = set(), set()
    for e in events:
        if e["type"] == "response.output_item.added":
            assert e["output_index"] not in added
            added.add(e["output_index"])
        elif e["type"] == "response.output_item.done":
            assert e["output_index"] in added and e["output_index"] not in done
            done.add(e["output_index"])
        elif "output_index" in e:
            assert e["output_index"] in added and e["output_index"] not in done, e
    assert added == done
    return events


def as_chunk(data: dict[str, Any]) -> ChatChunk:
    """An engine chunk as the relay decodes it from the wire."""
    return chunk_decoder.decode(msgspec.json.encode(data))


def chunk(**delta: Any) -> ChatChunk:
    return as_chunk({"choices": [{"index": 0, "delta": delta}]})


def test_a_stream_of_reasoning_text_and_two_calls() -> None:
    s = ResponseStream(rs.Shell(request(tools=[WEATHER]), "m"))
    data = s.start() + s.feed(chunk(role="assistant")) + s.feed(chunk(reasoning_content="Think"))
    data += s.feed(chunk(content="Sure")) + s.feed(chunk(content="."))
    data += s.feed(chunk(tool_calls=[{"index": 0, "id": "c0", "function": {"name": "get_weather", "arguments": ""}}]))
    data += s.feed(chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"city": '}}]))
    data += s.feed(chunk(tool_calls=[{"index": 0, "function": {"arguments": '"Oslo"}'}}]))
    data += s.feed(chunk(tool_calls=[{"index": 1, "id": "c1", "function": {"name": "get_weather", "arguments": "{}"}}]))
    data += s.feed(as_chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}))
    data += s.feed(as_chunk({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}))
    data += s.finish()
    events = parse(data)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert kinds.count("response.output_item.added") == 4
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Sure."
    args = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [a["arguments"] for a in args] == ['{"city": "Oslo"}', "{}"]
    final = events[-1]["response"]
    assert final["status"] == "completed" and s.response == final
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert final["output"][1]["content"] == [{"type": "output_text", "text": "Sure.", "annotations": [], "logprobs": []}]
    assert final["usage"]["total_tokens"] == 13


def test_a_stream_that_runs_out_of_tokens_is_incomplete() -> None:
    s = ResponseStream(rs.Shell(request(), "m"))
    data = s.feed(chunk(content="abc")) + s.feed(as_chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}))
    events = parse(data + s.finish())
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_an_error_mid_stream_is_an_error_event_then_response_failed() -> None:
    s = ResponseStream(rs.Shell(request(), "m"))
    data = s.feed(chunk(content="ab")) + s.fail(502, "The engine crashed.", "engine_crashed")
    events = parse(data)
    error = next(e for e in events if e["type"] == "error")
    assert error["message"] == "The engine crashed." and error["code"] == "engine_crashed"  # OpenAI's flat shape
    assert error["error"] == {"type": "server_error", "code": "engine_crashed", "message": "The engine crashed.",
                              "param": None}  # the Open Responses nested one
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "engine_crashed", "message": "The engine crashed."}
    assert s.finish() == b"" and s.fail(500, "again", None) == b""


def test_a_stored_response_replays_as_a_valid_stream() -> None:
    s = ResponseStream(rs.Shell(request(tools=[WEATHER]), "m"))
    s.feed(chunk(content="Hi"))
    s.feed(chunk(tool_calls=[{"index": 0, "id": "c0", "function": {"name": "get_weather", "arguments": "{}"}}]))
    s.finish()
    assert s.response is not None
    events = parse(replay(s.response))
    assert events[-1]["response"] == s.response
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"] == ["message", "function_call"]


def full_stream() -> list[ChatChunk]:
    return [chunk(role="assistant"), chunk(reasoning_content="Hm."), chunk(content="Sure"), chunk(content="."),
            chunk(tool_calls=[{"index": 0, "id": "c0", "function": {"name": "get_weather", "arguments": '{"ci'}}]),
            chunk(tool_calls=[{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]),
            as_chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
            as_chunk({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}})]


@pytest.mark.parametrize("cut", range(len(full_stream()) + 1))
def test_a_stream_cut_after_any_chunk_still_ends_as_a_valid_failed_stream(cut: int) -> None:
    """The engine gone after `cut` chunks (the relay then calls `fail`): the caller still gets
    a valid event sequence, ending with `error` and `response.failed`."""
    s = ResponseStream(rs.Shell(request(tools=[WEATHER]), "m"))
    data = s.start() + b"".join(s.feed(c) for c in full_stream()[:cut])
    events = parse(data + s.fail(502, "The engine crashed.", "engine_crashed"))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
