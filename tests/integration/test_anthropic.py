"""Anthropic's Messages API through a real supervisor, with the official anthropic SDK: on a
real SmolLM2 engine (text, streams and their event helpers, stop sequences, a tool round
trip, count_tokens, the model list, a Claude Code shaped request), and on a fake engine for
what a real one cannot do on cue (dying mid-stream), plus every error in Anthropic's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2 as httpx
import pytest

from tests.support import SupervisorProcess, fake_supervisor, http10_post, serving

MODEL = "smol"
COUNT = [{"role": "user", "content": "Count from 1 to 10."}]
GREEDY = {"temperature": 0}  # the SDK no longer types sampling fields: they go as extra body
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                            "additionalProperties": False}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def sup(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    with serving(smollm2, MODEL, tmp_path_factory.mktemp("anthropic")) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(sup: SupervisorProcess) -> anthropic.Anthropic:
    return sup.anthropic()


def create(client: anthropic.Anthropic, **kw: Any) -> Any:
    return client.messages.create(**{"model": MODEL, "max_tokens": 40, "messages": COUNT, "extra_body": GREEDY, **kw})


def test_a_message_with_text_usage_and_a_stop_reason(client: anthropic.Anthropic) -> None:
    msg = create(client)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.id.startswith("msg_")
    (block,) = msg.content
    assert block.type == "text" and "1" in block.text
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 10
    assert 0 < msg.usage.output_tokens <= 40


def test_the_stream_helpers_see_anthropics_event_sequence_and_the_same_message(client: anthropic.Anthropic) -> None:
    whole = create(client)
    with client.messages.stream(model=MODEL, max_tokens=40, messages=COUNT, extra_body=GREEDY) as stream:
        seen = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in seen]
    raw = [k for k in kinds if k not in ("text", "input_json", "thinking", "signature")]  # the helper's own events
    # message_start says the prompt's tokens (clients that track their context read them there)
    opening = seen[0].message.usage  # type: ignore[union-attr]
    assert opening.input_tokens + (opening.cache_read_input_tokens or 0) == \
        final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) > 10
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]
    assert raw[1] == "content_block_start" and raw[-3] == "content_block_stop"
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_ends_the_reply_and_is_named(client: anthropic.Anthropic) -> None:
    msg = create(client, stop_sequences=["5."])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "5."
    assert "5." not in msg.content[0].text and "4" in msg.content[0].text
    with client.messages.stream(model=MODEL, max_tokens=40, messages=COUNT, stop_sequences=["5."],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "5."


def test_a_tool_round_trip(client: anthropic.Anthropic) -> None:
    call = create(client, messages=ASK_WEATHER, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
                  max_tokens=60)
    assert call.stop_reason == "tool_use"
    (use,) = [b for b in call.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    history = [*ASK_WEATHER, {"role": "assistant", "content": [b.model_dump() for b in call.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": [{"type": "text", "text": "Sunny, 21 C."}]}]}]
    answer = create(client, messages=history, tools=[WEATHER], max_tokens=40)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text.strip()


def test_a_streamed_tool_call_arrives_as_input_json_deltas(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, max_tokens=60, messages=ASK_WEATHER, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    assert deltas and json.loads("".join(deltas)) == {"city": "Paris"}
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", {"city": "Paris"})]


def test_count_tokens_counts_the_prompt_generation_sees(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model=MODEL, messages=COUNT)
    used = create(client, max_tokens=1).usage
    assert counted.input_tokens == used.input_tokens + (used.cache_read_input_tokens or 0)
    with_tools = client.messages.count_tokens(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER])
    assert with_tools.input_tokens > client.messages.count_tokens(model=MODEL, messages=ASK_WEATHER).input_tokens


def test_the_model_list_in_anthropics_shape(client: anthropic.Anthropic, sup: SupervisorProcess) -> None:
    (model,) = client.models.list().data
    assert model.id == MODEL and model.type == "model"
    assert sup.client.get("/v1/models").json()["object"] == "list"  # no anthropic-version: OpenAI's shape


def test_a_claude_code_shaped_request_is_served(sup: SupervisorProcess) -> None:
    """What Claude Code sends: `?beta=true`, beta headers, a system list, thinking with a
    budget, max_tokens far past the model's window (clamped), metadata and beta fields."""
    body = {
        "model": MODEL, "max_tokens": 32000, "stream": True,
        "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi.", "cache_control": {"type": "ephemeral"}}]}],
        "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}],
        "thinking": {"type": "enabled", "budget_tokens": 31999, "display": "omitted"},
        "metadata": {"user_id": "user_abc"}, "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
        "temperature": 0,
    }
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
               "x-api-key": "unused"}
    with sup.client.stream("POST", "/v1/messages?beta=true", json=body, headers=headers) as resp:
        assert resp.status_code == 200
        text = "".join(resp.iter_text())
    names = [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    stop = json.loads(text.split("event: message_delta\ndata: ")[1].split("\n")[0])["delta"]["stop_reason"]
    assert stop in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.slow  # a 45k-token prefill on a CPU: about 40 s
def test_a_claude_code_prompt_of_45k_tokens_starts_on_a_64k_model_at_defaults(tmp_path: Path) -> None:
    """Claude Code's first prompt is 12k-51k tokens (its tools, its instructions, CLAUDE.md:
    docs/clients.md); before `batch = "auto"` a fixed 32k KV budget refused those past it."""
    from mlxd.engine.models.random_model import build_random_llama

    model = build_random_llama(tmp_path / "long", context=65536, num_heads=2, num_kv_heads=1)
    with serving(model, "long", tmp_path / "data") as sup:  # mlxd's defaults: no batch, no KV settings
        guide = " ".join(f"rule {i}: keep functions short and name things plainly." for i in range(960))
        body: dict[str, Any] = {
            "model": "long", "max_tokens": 32000, "stream": True,
            "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": guide, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}],
            "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}],
            "thinking": {"type": "enabled", "budget_tokens": 31999}, "metadata": {"user_id": "u"},
        }
        headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219", "x-api-key": "unused"}
        counted = sup.client.post("/v1/messages/count_tokens", json={k: v for k, v in body.items() if k not in (
            "max_tokens", "stream", "thinking", "metadata")}, headers=headers)
        assert 44_090 < counted.json()["input_tokens"] < 65536, counted.text  # past the old 32k budget and Claude Code's 44k
        events: list[str] = []
        with sup.client.stream("POST", "/v1/messages?beta=true", json=body, headers=headers,
                               timeout=httpx.Timeout(600)) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("event: "):
                    events.append(line.removeprefix("event: "))
                if "content_block_delta" in events:
                    break  # prefilled and decoding: the turn has started; leaving cancels the rest
        assert events[0] == "message_start", events
        stats = next(e for e in sup.client.get("/admin/engines").json()["data"] if e["model"] == "long")
        assert stats["width"] >= 1 and stats["kv_budget_tokens"] >= 65536, stats


def anthropic_error(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}, body
    return dict(body["error"])


@pytest.mark.parametrize(("body", "status", "kind"), [
    (b"{not json", 400, "invalid_request_error"),
    (json.dumps({"model": MODEL, "messages": COUNT}).encode(), 400, "invalid_request_error"),  # no max_tokens
    (json.dumps({"model": MODEL, "max_tokens": "ten", "messages": COUNT}).encode(), 400, "invalid_request_error"),
    (json.dumps({"model": MODEL, "max_tokens": 5, "messages": []}).encode(), 400, "invalid_request_error"),
    (json.dumps({"model": MODEL, "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "hologram"}]}]}).encode(), 400, "invalid_request_error"),
    (json.dumps({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}).encode(),
     400, "invalid_request_error"),
    (json.dumps({"model": "nope", "max_tokens": 5, "messages": COUNT}).encode(), 404, "not_found_error"),
])
def test_bad_requests_get_anthropic_errors(sup: SupervisorProcess, body: bytes, status: int, kind: str) -> None:
    resp = sup.client.post("/v1/messages", content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == status
    assert anthropic_error(resp)["type"] == kind


def test_the_sdk_raises_its_own_errors(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=5, messages=COUNT)
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])


def test_an_unknown_route_under_messages_is_an_anthropic_404(sup: SupervisorProcess) -> None:
    resp = sup.client.post("/v1/messages/batches", json={})
    assert resp.status_code == 404 and anthropic_error(resp)["type"] == "not_found_error"


# --- on a fake engine: keys, sizes and a crash mid-stream ---

@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    config = '[server]\napi_keys = ["sk-a"]\nmax_body_bytes = 65536\n'
    proc = fake_supervisor(tmp_path_factory.mktemp("anthropic-fake"), "exit_midway", config=config)
    yield proc
    proc.stop()


def test_a_missing_key_is_an_anthropic_401(fake: SupervisorProcess) -> None:
    with pytest.raises(anthropic.AuthenticationError):
        fake.anthropic(api_key="wrong").messages.create(model="fake", max_tokens=5, messages=COUNT)
    resp = fake.client.post("/v1/messages", json={"model": "fake", "max_tokens": 5, "messages": COUNT})
    assert resp.status_code == 401 and anthropic_error(resp)["type"] == "authentication_error"


def test_an_oversize_body_is_an_anthropic_413(fake: SupervisorProcess) -> None:
    big = {"model": "fake", "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 100_000}]}
    resp = fake.client.post("/v1/messages", json=big, headers={"x-api-key": "sk-a"})
    assert resp.status_code == 413 and anthropic_error(resp)["type"] == "request_too_large"


def test_an_engine_dying_mid_stream_ends_it_with_an_anthropic_error_event(fake: SupervisorProcess) -> None:
    client = fake.anthropic(api_key="sk-a")
    seen: list[str] = []
    # the SDK raises on the stream's error event
    with pytest.raises(anthropic.APIStatusError) as info, \
            client.messages.stream(model="fake", max_tokens=8, messages=COUNT) as stream:
        for event in stream:
            seen.append(event.type)
    assert "content_block_delta" in seen  # the reply had begun
    assert "restarted" in str(info.value)
    # the engine restarts: the next request is served whole (the fake dies again only mid-stream)
    with client.messages.stream(model="fake", max_tokens=2, messages=COUNT) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == "t0 t1 " and final.stop_reason == "max_tokens"


def test_an_http10_caller_gets_the_translated_stream_unframed_and_its_error_event(fake: SupervisorProcess) -> None:
    """HTTP/1.0 (nginx's default upstream protocol) has no chunked encoding, so the translated
    stream goes through aiohttp's writer instead of the read callback: the same events, the
    body running to the close, and the engine's death mid-stream is the error event."""
    body = json.dumps({"model": "fake", "stream": True, "max_tokens": 8, "messages": COUNT}).encode()
    head, payload = http10_post(fake.port, "/v1/messages", body, b"x-api-key: sk-a")
    assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower()
    names = [block.split("\n")[0].removeprefix("event: ") for block in payload.decode().split("\n\n") if block]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names.count("content_block_delta") == 3  # the fake engine sends three tokens, then dies
    assert names[-1] == "error"


def test_a_bad_output_schema_is_an_anthropic_400(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="not usable"):
        client.messages.create(model=MODEL, max_tokens=5, messages=COUNT, output_config={
            "format": {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": 12}}}}})
