"""The Responses API through a real supervisor with the official openai SDK: on a real
SmolLM2 engine (create, stream, chain, retrieve, replay, delete, input items, a function
call round trip, text.format, a Codex-shaped request), and on a fake engine for the store's
durability (a SIGKILLed supervisor), concurrent chains and an engine dying mid-stream."""

from __future__ import annotations

import concurrent.futures as cf
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support import SupervisorProcess, fake_supervisor, serving

MODEL = "smol"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


@pytest.fixture(scope="module")
def sup(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    with serving(smollm2, MODEL, tmp_path_factory.mktemp("responses")) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(sup: SupervisorProcess) -> openai.OpenAI:
    return sup.openai()


def create(client: openai.OpenAI, **kw: Any) -> Any:
    return client.responses.create(**{"model": MODEL, "input": "Count from 1 to 5.", "max_output_tokens": 40,
                                       "temperature": 0, **kw})


def events_of(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_a_response_and_the_same_streamed(client: openai.OpenAI) -> None:
    ask = "What is the capital of France? Answer in one word."  # a short whole answer: "completed"
    whole = create(client, input=ask, max_output_tokens=200)
    assert whole.object == "response" and whole.status == "completed" and whole.model == MODEL
    assert whole.id.startswith("resp_") and "Paris" in whole.output_text
    assert whole.usage.input_tokens > 10 and 0 < whole.usage.output_tokens <= 200
    with client.responses.stream(model=MODEL, input=ask, max_output_tokens=200, temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert final.output_text == whole.output_text and final.status == "completed"


def test_running_out_of_tokens_is_incomplete(client: openai.OpenAI) -> None:
    out = create(client, max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"


def test_a_chain_is_its_earlier_turns_and_instructions_are_not_carried(client: openai.OpenAI) -> None:
    """The chained turn's prompt is exactly the one the same conversation makes sent whole:
    the first turn's input and output, then the new input, and not the first's instructions."""
    first = create(client, input="My name is Alice.", instructions="Always answer in one sentence. " * 20)
    second = create(client, input="What is my name?", previous_response_id=first.id, max_output_tokens=5)
    assert second.status in ("completed", "incomplete") and second.previous_response_id == first.id
    assert second.instructions is None
    whole = create(client, max_output_tokens=5, input=[
        {"role": "user", "content": "My name is Alice."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert second.output_text == whole.output_text  # greedy: the same prompt, the same answer


def test_retrieve_replay_input_items_and_delete(client: openai.OpenAI, sup: SupervisorProcess) -> None:
    out = create(client, input=[{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"},
                                {"role": "user", "content": "Count from 1 to 3."}])
    assert client.responses.retrieve(out.id).output_text == out.output_text
    replay = sup.client.get(f"/v1/responses/{out.id}", params={"stream": "true"})
    assert replay.headers["content-type"].startswith("text/event-stream")
    events = events_of(replay.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert events[-1]["response"] == sup.client.get(f"/v1/responses/{out.id}").json()
    items = client.responses.input_items.list(out.id, order="asc")
    assert [(i.type, i.role) for i in items.data] == [("message", "user"), ("message", "assistant"), ("message", "user")]
    page = client.responses.input_items.list(out.id, limit=2)  # desc by default
    assert [i.id for i in page.data] == [items.data[2].id, items.data[1].id] and page.has_more
    client.responses.delete(out.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)
    with pytest.raises(openai.NotFoundError) as info:
        create(client, previous_response_id=out.id)
    assert info.value.body["code"] == "previous_response_not_found"  # type: ignore[index]


def test_store_false_is_not_kept(client: openai.OpenAI) -> None:
    out = create(client, store=False)
    assert out.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)


def test_a_function_call_round_trip(client: openai.OpenAI) -> None:
    call = create(client, input="What is the weather in Paris?", tools=[WEATHER],
                  tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    (item,) = [o for o in call.output if o.type == "function_call"]
    assert item.name == "get_weather" and json.loads(item.arguments) == {"city": "Paris"} and item.call_id
    answer = create(client, previous_response_id=call.id, tools=[WEATHER], max_output_tokens=40,
                    input=[{"type": "function_call_output", "call_id": item.call_id, "output": "Sunny, 21 C."}])
    assert answer.status == "completed" and answer.output_text.strip()


def test_a_streamed_function_call(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                 tool_choice="required", temperature=0, max_output_tokens=60) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    (item,) = final.output
    assert item.type == "function_call" and json.loads(item.arguments) == {"city": "Paris"}


def test_text_format_holds_the_output_to_a_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    out = create(client, input="Make up a person.", max_output_tokens=60,
                 text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}})
    person = json.loads(out.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


def test_a_codex_shaped_request_is_served(sup: SupervisorProcess) -> None:
    """What Codex CLI sends: developer messages, a namespace of functions, a hosted tool it
    cannot have here, include, prompt_cache_key, client_metadata, store false, a stream."""
    body = {
        "model": MODEL, "stream": True, "store": False, "parallel_tool_calls": False, "temperature": 0,
        "max_output_tokens": 30, "instructions": "You are a coding agent.",
        "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hi."}]}],
        "tools": [{"type": "namespace", "name": "mcp__shell", "tools": [WEATHER]}, {"type": "web_search"}],
        "tool_choice": "auto", "include": ["reasoning.encrypted_content"], "prompt_cache_key": "abc",
        "client_metadata": {"originator": "codex"}, "reasoning": {"effort": "low", "summary": "auto"},
    }
    with sup.client.stream("POST", "/v1/responses", json=body) as resp:
        assert resp.status_code == 200
        events = events_of(resp.read().decode())
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert events[-1]["response"]["store"] is False
    assert [t["name"] for t in events[-1]["response"]["tools"]] == ["get_weather"]


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-1"}]}]}, 400, "input[0].content[0].image_url"),
    # A model without vision: refused naming the part, before any engine starts.
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text", "text": "x"},
        {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]}, 400, "input[0].content[1]"),
    ({"model": MODEL, "input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     400, "tool_choice.name"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"model": MODEL, "input": 5}, 400, "input"),
    ({"model": "nope", "input": "x"}, 404, "model"),
    ({"model": MODEL, "input": "x", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
])
def test_bad_requests_get_openai_errors(sup: SupervisorProcess, body: dict[str, Any], status: int, param: str) -> None:
    resp = sup.client.post("/v1/responses", json=body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param


def test_unknown_ids_and_bad_pages_get_openai_errors(sup: SupervisorProcess) -> None:
    for method, path in (("GET", "/v1/responses/resp_x"), ("DELETE", "/v1/responses/resp_x"),
                         ("GET", "/v1/responses/resp_x/input_items")):
        resp = sup.client.request(method, path)
        assert resp.status_code == 404 and "resp_x" in resp.json()["error"]["message"]
    assert sup.client.post("/v1/responses", content=b"{oops", headers={"Content-Type": "application/json"}
                           ).status_code == 400


# --- on a fake engine: durability, concurrent chains, a crash mid-stream ---

def test_a_stored_response_survives_a_sigkilled_supervisor(tmp_path: Path) -> None:
    sup = fake_supervisor(tmp_path)
    try:
        first = sup.openai().responses.create(model="fake", input="hello")
        assert first.status == "completed"
    finally:
        sup.proc.kill()
        sup.stop()
    again = fake_supervisor(tmp_path)  # the same data dir
    try:
        client = again.openai()
        assert client.responses.retrieve(first.id).id == first.id
        chained = client.responses.create(model="fake", input="again", previous_response_id=first.id)
        assert chained.status == "completed" and chained.previous_response_id == first.id
    finally:
        again.stop()


def test_concurrent_chains_on_one_response_each_get_their_own(tmp_path: Path) -> None:
    sup = fake_supervisor(tmp_path)
    try:
        client = sup.openai()
        root = client.responses.create(model="fake", input="start")
        with cf.ThreadPoolExecutor(6) as pool:
            branches = list(pool.map(lambda i: client.responses.create(
                model="fake", input=f"branch {i}", previous_response_id=root.id), range(6)))
        assert len({b.id for b in branches}) == 6
        for b in branches:
            got = client.responses.retrieve(b.id)
            assert got.previous_response_id == root.id
            assert [i.content[0].text for i in client.responses.input_items.list(b.id).data] == [
                f"branch {branches.index(b)}"]
    finally:
        sup.stop()


def test_an_engine_dying_mid_stream_is_an_error_event_then_response_failed(tmp_path: Path) -> None:
    sup = fake_supervisor(tmp_path, "exit_midway")
    try:
        with sup.client.stream("POST", "/v1/responses", json={"model": "fake", "input": "x", "stream": True,
                                                              "max_output_tokens": 8}) as resp:
            events = events_of(resp.read().decode())
        kinds = [e["type"] for e in events]
        assert "response.output_text.delta" in kinds
        assert kinds[-2:] == ["error", "response.failed"]
        assert events[-1]["response"]["status"] == "failed" and "restarted" in events[-1]["response"]["error"]["message"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
    finally:
        sup.stop()


def test_a_schema_llguidance_cannot_use_is_a_400(sup: SupervisorProcess) -> None:
    bad = {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 12}}}}
    resp = sup.client.post("/v1/responses", json={"model": MODEL, "input": "x", "text": {"format": bad}})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert "not usable" in error["message"] and error["param"].startswith("text.format")
