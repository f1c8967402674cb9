"""Ollama's API mapped onto the engine's (mlxd/protocol/ollama.py): keep_alive durations, the
request mapping (options, format, think, tools, images) and the NDJSON stream translator."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import pytest

from mlxd.protocol import ollama, ollama_answers
from mlxd.protocol.chat_chunks import chunk_decoder
from mlxd.protocol.errors import APIError

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 40).decode()
JPEG = base64.b64encode(b"\xff\xd8\xff\xe0" + b"\0" * 40).decode()


@pytest.mark.parametrize(("value", "seconds"), [
    (None, None), (300, 300), (0, 0), ("0", 0), ("0s", 0), (-1, -1), ("-1", -1), ("-5m", -1), ("5m", 300),
    ("1h30m", 5400), ("90s", 90), ("1.5s", 2), ("250ms", 1), (" 10 ", 10), ("2h", 7200), (1e12, 2**31 - 1),
])
def test_keep_alive_is_seconds_or_a_go_duration(value: Any, seconds: int | None) -> None:
    assert ollama.keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5x", "m5", "", "1h 30m", "--1", "5m3"])
def test_a_keep_alive_that_is_not_a_duration_is_a_400(value: str) -> None:
    with pytest.raises(APIError) as info:
        ollama.keep_alive_seconds(value)
    assert info.value.status == 400 and info.value.param == "keep_alive"


def chat_request(**kw: Any) -> ollama.ChatRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    return msgspec.json.decode(json.dumps(body), type=ollama.ChatRequest)


def test_options_map_onto_the_engines_sampling_fields() -> None:
    body = ollama.chat_body(chat_request(options={
        "temperature": 0.3, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 4, "num_predict": 12, "stop": "END",
        "repeat_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.2, "num_ctx": 4096, "mirostat": 2}))
    assert body["temperature"] == 0.3 and body["top_p"] == 0.9 and body["top_k"] == 20 and body["min_p"] == 0.05
    assert body["seed"] == 4 and body["max_tokens"] == 12 and body["stop"] == ["END"]
    assert body["repetition_penalty"] == 1.1 and body["presence_penalty"] == 0.5 and body["frequency_penalty"] == 0.2
    assert "num_ctx" not in body and "mirostat" not in body
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}  # Ollama streams by default
    assert "max_tokens" not in ollama.chat_body(chat_request(options={"num_predict": -1}, stream=False))


def test_format_and_think_map_onto_a_grammar_and_the_template() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    held = ollama.chat_body(chat_request(format=schema, think="high"))
    assert held["response_format"]["json_schema"]["schema"] == schema
    assert held["reasoning_effort"] == "high" and held["chat_template_kwargs"] == {"enable_thinking": True}
    loose = ollama.chat_body(chat_request(format="json", think=False))
    assert loose["response_format"] == {"type": "json_object"}
    assert loose["chat_template_kwargs"] == {"enable_thinking": False} and "reasoning_effort" not in loose
    plain = ollama.chat_body(chat_request(format=""))
    assert "response_format" not in plain and "chat_template_kwargs" not in plain
    with pytest.raises(APIError, match="think"):
        ollama.chat_body(chat_request(think="max"))


def test_tool_calls_and_their_answers_pair_up_by_id() -> None:
    body = ollama.chat_body(chat_request(messages=[
        {"role": "user", "content": "weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
        {"role": "tool", "content": "rain", "tool_name": "get_weather"}]))
    calls = body["messages"][1]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    answers = body["messages"][2:]
    assert [a["tool_call_id"] for a in answers] == [c["id"] for c in calls]
    assert [a["name"] for a in answers] == ["get_weather", "get_weather"]


def test_images_become_data_uris_of_their_type() -> None:
    body = ollama.chat_body(chat_request(messages=[{"role": "user", "content": "what?", "images": [PNG, JPEG]}]))
    parts = body["messages"][0]["content"]
    assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert parts[1]["image_url"]["url"].startswith("data:image/jpeg;base64,")
    assert parts[2] == {"type": "text", "text": "what?"}
    with pytest.raises(APIError) as info:
        ollama.chat_body(chat_request(messages=[{"role": "user", "content": "x", "images": ["aGVsbG8="]}]))
    assert info.value.param == "messages[0].images[0]"


def test_generate_is_a_chat_turn_or_with_raw_a_text_completion() -> None:
    def gen(**kw: Any) -> tuple[bool, dict[str, Any]]:
        return ollama.generate_body(msgspec.json.decode(json.dumps({"model": "m", **kw}), type=ollama.GenerateRequest))

    raw, body = gen(prompt="Once", system="Be brief.", stream=False)
    assert not raw and body["messages"] == [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Once"}]
    raw, body = gen(prompt="<s>Once", raw=True, format="json")
    assert raw and body["prompt"] == "<s>Once" and body["response_format"] == {"type": "json_object"}
    for bad, param in (({"suffix": "end"}, "suffix"), ({"template": "{{ .Prompt }}"}, "template"),
                       ({"raw": True, "images": [PNG]}, "images")):
        with pytest.raises(APIError) as info:
            gen(prompt="x", **bad)
        assert info.value.param == param


def chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, Any] | None = None) -> Any:
    return chunk_decoder.decode(json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                                            "usage": usage}))


def lines(blob: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in blob.splitlines()]


def test_the_stream_sends_text_as_it_comes_and_calls_whole_before_the_last_line() -> None:
    stream = ollama_answers.OllamaStream("m", "chat", started=0.0)
    out = stream.start() + stream.feed(chunk({"reasoning_content": "hmm"})) + stream.feed(chunk({"content": "Hi"}))
    out += stream.feed(chunk({"tool_calls": [{"index": 0, "id": "call_x", "function": {"name": "f", "arguments": ""}}]}))
    out += stream.feed(chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}))
    out += stream.feed(chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}, "tool_calls"))
    out += stream.feed(chunk({}, usage={"prompt_tokens": 7, "completion_tokens": 5}))
    out += stream.finish()
    got = lines(out)
    assert got[0]["message"] == {"role": "assistant", "content": "", "thinking": "hmm"}
    assert got[1]["message"] == {"role": "assistant", "content": "Hi"}
    assert got[2]["message"]["tool_calls"] == [{"id": "call_x", "function": {"index": 0, "name": "f", "arguments": {"a": 1}}}]
    last = got[3]
    assert last["done"] is True and last["done_reason"] == "stop"
    assert last["prompt_eval_count"] == 7 and last["eval_count"] == 5
    assert [g["done"] for g in got] == [False, False, False, True]
    assert stream.finish() == b"" and stream.fail(500, "late") == b""  # once ended, nothing more


def test_a_generate_stream_writes_response_and_an_error_ends_it() -> None:
    stream = ollama_answers.OllamaStream("m", "generate", started=0.0)
    first = lines(stream.feed(chunk_decoder.decode(b'{"choices": [{"index": 0, "text": "Once", "finish_reason": null}]}')))
    assert first == [{"model": "m", "created_at": first[0]["created_at"], "response": "Once", "done": False}]
    assert lines(stream.fail(500, "The engine restarted.")) == [{"error": "The engine restarted."}]
    assert stream.ended


def test_whole_answers_carry_the_engines_split_of_the_time() -> None:
    timing = ollama_answers.Timing(started=0.0)
    timing.split(120.0, 880.0)
    made = ollama_answers.answer({"choices": [{"message": {"content": "ok", "reasoning_content": "r", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "not json"}}]}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2}}, "m", "chat", timing)
    answer = json.loads(msgspec.json.encode(made))
    assert answer["message"]["thinking"] == "r" and answer["message"]["tool_calls"][0]["function"]["arguments"] == {}
    assert answer["done_reason"] == "length" and answer["prompt_eval_duration"] == 120_000_000
    assert answer["eval_duration"] == 880_000_000 and answer["eval_count"] == 2
