"""POST /v1/chat/render on a real SmolLM2 engine: the prompt a chat request becomes, counted
exactly as generation counts it (tools and a forced call included), without generating;
bad requests get the same 400s as chat."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import EngineProcess

ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("extra", [
    {},
    {"tools": [WEATHER]},
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
], ids=["plain", "tools", "forced call"])
def test_the_count_is_what_generation_counts(smol_engine: EngineProcess, extra: dict[str, Any]) -> None:
    body = {"messages": ASK, **extra}
    rendered = smol_engine.client.post("/v1/chat/render", json=body)
    assert rendered.status_code == 200, rendered.text
    out = rendered.json()
    generated = smol_engine.client.post("/v1/chat/completions", json={**body, "max_tokens": 1}).json()
    assert out["prompt_tokens"] == generated["usage"]["prompt_tokens"] == len(out["token_ids"])
    assert "Be brief." in out["text"] and "capital of France" in out["text"]
    assert out["model"] == "SmolLM2-135M-Instruct" and out["context_window"] > out["prompt_tokens"]


def test_rendering_generates_nothing(smol_engine: EngineProcess) -> None:
    before = smol_engine.stats()
    assert smol_engine.client.post("/v1/chat/render", json={"messages": ASK}).status_code == 200
    after = smol_engine.stats()
    assert after["requests"]["total"] == before["requests"]["total"]
    assert after["tokens"] == before["tokens"]


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
])
def test_bad_requests_get_chats_400s(smol_engine: EngineProcess, body: dict[str, Any], param: str) -> None:
    resp = smol_engine.client.post("/v1/chat/render", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param


def test_malformed_json_is_a_400(smol_engine: EngineProcess) -> None:
    resp = smol_engine.client.post("/v1/chat/render", content=b"{not json")
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
