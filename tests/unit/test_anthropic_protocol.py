"""protocol/anthropic.py: Anthropic requests to the engine's chat requests, chat answers (whole
and streamed) back to Anthropic's shapes; and the supervisor's SSE splitting, fed in pieces."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from mlxd.protocol import anthropic as an
from mlxd.protocol.anthropic_stream import MessageStream
from mlxd.protocol.chat_chunks import ChatChunk, chunk_decoder
from mlxd.protocol.errors import APIError
from mlxd.supervisor.relay.sse import SseEvents


def request(**kw: Any) -> an.MessagesRequest:
    body = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}], **kw}
    return msgspec.json.decode(json.dumps(body), type=an.MessagesRequest)


def test_a_plain_request_becomes_a_chat_request() -> None:
    chat = an.to_chat(request(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
                              temperature=0.2, top_k=5, stop_sequences=["END"]), stream=True)
    assert chat["messages"] == [{"role": "system", "content": "Be brief.\n\nBe kind."}, {"role": "user", "content": "hi"}]
    assert chat["max_tokens"] == 100 and chat["temperature"] == 0.2 and chat["top_k"] == 5 and chat["stop"] == ["END"]
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}


def test_tool_use_and_tool_results_become_calls_and_tool_messages() -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "rain"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": True},
            {"type": "text", "text": "And tomorrow?"}]},
    ]
    tools = [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}},
             {"type": "web_search_20250305", "name": "web_search"}]  # a server tool: left out
    chat = an.to_chat(request(messages=messages, tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True}))
    assert chat["messages"][1] == {
        "role": "assistant", "content": "Let me check.", "reasoning_content": "Use the tool.",
        "tool_calls": [{"id": "toolu_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    assert chat["messages"][2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
        {"role": "user", "content": "And tomorrow?"}]
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_weather"]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False


@pytest.mark.parametrize(("choice", "want"), [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
])
def test_tool_choices(choice: dict[str, Any], want: Any) -> None:
    chat = an.to_chat(request(tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice=choice))
    assert chat["tool_choice"] == want


def test_thinking_output_config_and_unknown_fields() -> None:
    chat = an.to_chat(request(thinking={"type": "enabled", "budget_tokens": 31999, "display": "omitted"},
                              output_config={"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}},
                              context_management={"edits": []}, metadata={"user_id": "u"}))
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert chat["reasoning_effort"] == "low"
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert an.to_chat(request(thinking={"type": "disabled"}))["chat_template_kwargs"] == {"enable_thinking": False}


PNG_SOURCE = {"type": "base64", "media_type": "image/png", "data": "AA=="}


def test_image_blocks_become_image_url_parts_in_order() -> None:
    content = [{"type": "text", "text": "Compare"}, {"type": "image", "source": PNG_SOURCE},
               {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}},
               {"type": "text", "text": "please."}]
    chat = an.to_chat(request(messages=[{"role": "user", "content": content}]))
    assert chat["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}}, {"type": "text", "text": "please."}]}]


def test_a_tool_result_with_an_image_keeps_it_and_an_error_says_so() -> None:
    result = {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
              "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}, {"type": "image", "source": PNG_SOURCE}]}
    (tool,) = an.to_chat(request(messages=[{"role": "user", "content": [result]}]))["messages"]
    assert tool == {"role": "tool", "tool_call_id": "t1", "content": [
        {"type": "text", "text": "Error: a\nb"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}
    text_only = {**result, "is_error": False, "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert an.to_chat(request(messages=[{"role": "user", "content": [text_only]}]))["messages"][0]["content"] == "a\nb"


@pytest.mark.parametrize(("content", "param"), [
    ([{"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "AA=="}}],
     "messages[0].content[0].source.media_type"),
    ([{"type": "image", "source": {"type": "file", "file_id": "f"}}], "messages[0].content[0].source"),
    ([{"type": "image", "source": {"type": "url"}}], "messages[0].content[0].source.url"),
    ([{"type": "document", "source": {"type": "text", "data": "x"}}], "messages[0].content[0]"),
    ([{"type": "tool_use", "id": "x", "name": "f", "input": {}}], "messages[0].content[0]"),  # in a user message
])
def test_what_cannot_be_said_is_a_400_naming_the_block(content: list[dict[str, Any]], param: str) -> None:
    with pytest.raises(APIError) as info:
        an.to_chat(request(messages=[{"role": "user", "content": content}]))
    assert info.value.status == 400 and info.value.param == param


def test_an_unknown_block_type_fails_to_decode() -> None:
    with pytest.raises(msgspec.ValidationError, match="content"):
        request(messages=[{"role": "user", "content": [{"type": "hologram", "data": 1}]}])


def test_a_tool_choice_naming_no_tool_is_a_400() -> None:
    with pytest.raises(APIError) as info:
        an.to_chat(request(tools=[{"name": "f"}], tool_choice={"type": "tool", "name": "g"}))
    assert info.value.param == "tool_choice.name"


def test_a_whole_chat_answer_becomes_a_message() -> None:
    completion = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Checking.", "reasoning_content": "hmm",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}}],
        "usage": {"prompt_tokens": 50, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 20}}}
    msg = an.from_chat(completion, "m")
    assert [b["type"] for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[2]["input"] == {"a": 1}
    assert msg.stop_reason == "tool_use"
    assert msg.usage.input_tokens == 30 and msg.usage.cache_read_input_tokens == 20
    assert msg.usage.output_tokens == 9


@pytest.mark.parametrize(("finish", "stop", "want"), [
    ("stop", None, "end_turn"), ("stop", "END", "stop_sequence"), ("length", None, "max_tokens"),
    ("tool_calls", None, "tool_use"),
])
def test_stop_reasons(finish: str, stop: str | None, want: str) -> None:
    msg = an.from_chat({"choices": [{"finish_reason": finish, "stop_reason": stop, "message": {"content": "x"}}]}, "m")
    assert msg.stop_reason == want
    assert msg.stop_sequence == (stop if want == "stop_sequence" else None)


def events(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in data.decode().split("\n\n"):
        if block:
            name, payload = block.split("\n")
            out.append((name.removeprefix("event: "), json.loads(payload.removeprefix("data: "))))
    return out


def as_chunk(data: dict[str, Any]) -> ChatChunk:
    """An engine chunk as the relay decodes it from the wire."""
    return chunk_decoder.decode(msgspec.json.encode(data))


def chunk(**delta: Any) -> ChatChunk:
    return as_chunk({"choices": [{"index": 0, "delta": delta}]})


def test_a_stream_of_thinking_text_and_two_calls_gets_blocks_in_order() -> None:
    s = MessageStream("m")
    data = s.feed(chunk(role="assistant"))
    data += s.feed(chunk(reasoning_content="Let me "))
    data += s.feed(chunk(reasoning_content="think."))
    data += s.feed(chunk(content="Sure."))
    data += s.feed(chunk(tool_calls=[{"index": 0, "id": "c0", "type": "function", "function": {"name": "f", "arguments": ""}}]))
    data += s.feed(chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"a"'}}]))
    data += s.feed(chunk(tool_calls=[{"index": 0, "function": {"arguments": ": 1}"}}]))
    data += s.feed(chunk(tool_calls=[{"index": 1, "id": "c1", "type": "function", "function": {"name": "g", "arguments": "{}"}}]))
    data += s.feed(as_chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}))
    data += s.feed(as_chunk({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 7}}))
    data += s.finish()
    evs = events(data)
    names = [n for n, _ in evs]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    starts = [e["content_block"] for n, e in evs if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "text", "tool_use", "tool_use"]
    assert [b.get("name") for b in starts[2:]] == ["f", "g"]
    # every block opens, gets its deltas and stops before the next opens, numbered from 0
    current = None
    for n, e in evs:
        if n == "content_block_start":
            assert current is None
            current = e["index"]
        elif n == "content_block_delta":
            assert e["index"] == current
        elif n == "content_block_stop":
            assert e["index"] == current
            current = None
    assert current is None
    assert [e["index"] for n, e in evs if n == "content_block_start"] == [0, 1, 2, 3]
    partial = "".join(e["delta"]["partial_json"] for n, e in evs if n == "content_block_delta" and e["index"] == 2)
    assert json.loads(partial) == {"a": 1}
    delta = evs[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"]["input_tokens"] == 12 and delta["usage"]["output_tokens"] == 7


def test_a_stream_ended_by_a_stop_string_says_which() -> None:
    s = MessageStream("m")
    data = s.feed(chunk(content="1, 2, 3"))
    data += s.feed(as_chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": ", 4"}]}))
    data += s.finish()
    delta = events(data)[-2][1]["delta"]
    assert delta == {"stop_reason": "stop_sequence", "stop_sequence": ", 4"}


def test_message_start_carries_the_prompts_tokens_from_the_first_chunk() -> None:
    """The engine's opening chunk carries the prompt's usage (process.EARLY_USAGE_HEADER):
    message_start says it, split into what the prompt cache held and the rest, as Anthropic's."""
    s = MessageStream("m")
    assert s.start() == b""  # nothing before the engine's first chunk
    opening = as_chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
                        "usage": {"prompt_tokens": 50, "completion_tokens": 0, "prompt_tokens_details": {"cached_tokens": 20}}})
    data = s.feed(opening) + s.feed(chunk(content="Hi"))
    data += s.feed(as_chunk({"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 3,
                                                      "prompt_tokens_details": {"cached_tokens": 20}}}))
    evs = events(data + s.finish())
    start = evs[0][1]["message"]["usage"]
    assert evs[0][0] == "message_start" and start["input_tokens"] == 30 and start["cache_read_input_tokens"] == 20
    assert start["output_tokens"] == 0
    assert evs[-2][1]["usage"]["input_tokens"] == 30 and evs[-2][1]["usage"]["output_tokens"] == 3


def test_an_empty_reply_still_makes_a_whole_event_sequence() -> None:
    s = MessageStream("m")
    names = [n for n, _ in events(s.finish())]
    assert names == ["message_start", "ping", "message_delta", "message_stop"]
    assert s.finish() == b""  # once


def test_sse_events_split_anywhere_come_out_whole() -> None:
    stream = b'data: {"a": 1}\n\n: keep-alive\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    for cut in range(1, len(stream)):
        events_ = SseEvents()
        got = events_.feed(stream[:cut]) + events_.feed(stream[cut:])
        assert got == [b'{"a": 1}', None, b'{"b": 2}', b"[DONE]"], cut


def test_errors_in_anthropics_shape() -> None:
    assert an.error_body(404, "no").error == an.AnthropicErrorDetail("not_found_error", "no")
    assert an.error_body(503, "busy").error.type == "overloaded_error"
    assert an.error_body(502, "crashed").error.type == "api_error"
    name, body = events(an.error_event(500, "boom"))[0]
    assert name == "error" and body == {"type": "error", "error": {"type": "api_error", "message": "boom"}}


def test_system_turns_join_the_system_prompt_first() -> None:
    """Claude Code 2.1 sends `system` turns among its messages; most chat templates take a
    system message only first."""
    chat = an.to_chat(request(system="Base.", messages=[
        {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": "Reminder."}]},
        {"role": "assistant", "content": "hello"}]))
    assert chat["messages"] == [{"role": "system", "content": "Base.\n\nReminder."}, {"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "hello"}]
    with pytest.raises(APIError) as info:
        an.to_chat(request(messages=[{"role": "system", "content": [{"type": "tool_use", "id": "x", "name": "f"}]}]))
    assert info.value.param == "messages[0].content[0]"


def full_stream() -> list[ChatChunk]:
    return [chunk(role="assistant"), chunk(reasoning_content="Hm."), chunk(content="Sure"),
            chunk(tool_calls=[{"index": 0, "id": "c0", "function": {"name": "f", "arguments": '{"a"'}}]),
            chunk(tool_calls=[{"index": 0, "function": {"arguments": ": 1}"}}]),
            as_chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
            as_chunk({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}})]


@pytest.mark.parametrize("cut", range(len(full_stream()) + 1))
def test_a_stream_cut_after_any_chunk_ends_with_an_error_event(cut: int) -> None:
    """The engine gone after `cut` chunks (the relay then calls `fail`): every event before
    is well formed and in order, and the last is Anthropic's error event."""
    s = MessageStream("m")
    data = s.start() + b"".join(s.feed(c) for c in full_stream()[:cut]) + s.fail(502, "The engine crashed.")
    evs = events(data)
    # message_start goes with the engine's first chunk: cut before it, the error is all there is
    assert [n for n, _ in evs[:2]] == (["message_start", "ping"] if cut else ["error"])
    assert evs[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "The engine crashed."}})
    assert "message_stop" not in [n for n, _ in evs]
    opened = [e["index"] for n, e in evs if n == "content_block_start"]
    assert opened == list(range(len(opened)))
    assert s.finish() == b""  # nothing after the error
