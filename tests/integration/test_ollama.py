"""Ollama's API through a real supervisor, with the official `ollama` Python client: on real
SmolLM2 engines (chat and generate, whole and streamed, the same text as the OpenAI routes
give; format, think, a tool round trip's history, keep_alive, the model list, show and ps),
and on fake engines for what real ones cannot do on cue (a streamed tool call in pieces, a
death mid-stream), plus errors in Ollama's shape (`{"error": "..."}` and the status)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx2 as httpx
import ollama
import pytest

from tests.support import (
    THINKING_TEMPLATE,
    SupervisorProcess,
    fake_supervisor,
    model_with_template,
    wait_for,
)

MODEL = "smol"
THINKER = "smol-think"
ASK = [{"role": "user", "content": "Count from 1 to 10."}]
GREEDY = {"temperature": 0, "num_predict": 16}


@pytest.fixture(scope="module")
def sup(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    root = tmp_path_factory.mktemp("ollama")
    thinker = model_with_template(smollm2, root / THINKER, THINKING_TEMPLATE)
    toml = f'[models.{MODEL}]\npath = "{smollm2}"\n[models.{THINKER}]\npath = "{thinker}"\n'
    proc = SupervisorProcess(toml, root / "data").wait_up()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(sup: SupervisorProcess) -> Iterator[ollama.Client]:
    c = ollama.Client(host=sup.url, timeout=120)
    yield c
    c._client.close()


def chat(client: ollama.Client, **kw: Any) -> Any:
    return client.chat(**{"model": MODEL, "messages": ASK, "options": GREEDY, **kw})


def test_a_chat_is_the_openai_routes_answer_whole_and_streamed(client: ollama.Client, sup: SupervisorProcess) -> None:
    whole = chat(client)
    openai_answer = sup.openai().chat.completions.create(model=MODEL, messages=ASK, temperature=0,  # type: ignore[arg-type]
                                                         max_tokens=16)
    assert whole.message.role == "assistant" and whole.message.content == openai_answer.choices[0].message.content
    assert whole.done and whole.done_reason == "length" and whole.model == MODEL
    assert whole.prompt_eval_count == openai_answer.usage.prompt_tokens and whole.eval_count == 16
    assert whole.eval_duration > 0 and whole.total_duration >= whole.eval_duration
    parts = list(chat(client, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "length"
    assert parts[-1].eval_count == 16 and parts[-1].prompt_eval_count == whole.prompt_eval_count
    assert datetime.fromisoformat(parts[0].created_at).tzinfo is not None


def test_the_tag_latest_names_the_same_model(client: ollama.Client) -> None:
    assert chat(client, model=MODEL + ":latest").message.content == chat(client).message.content


def test_generate_with_a_system_prompt_and_raw(client: ollama.Client, sup: SupervisorProcess) -> None:
    out = client.generate(model=MODEL, prompt="Count from 1 to 10.", options=GREEDY)
    assert out.response == chat(client).message.content and out.done_reason == "length"
    told = client.generate(model=MODEL, prompt="Count from 1 to 10.", system="Answer in French.", options=GREEDY)
    same = sup.openai().chat.completions.create(model=MODEL, temperature=0, max_tokens=16, messages=[  # type: ignore[arg-type]
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Count from 1 to 10."}])
    assert told.response == same.choices[0].message.content and told.prompt_eval_count == same.usage.prompt_tokens
    raw = client.generate(model=MODEL, prompt="The capital of France is", raw=True, options={**GREEDY, "num_predict": 6})
    text = sup.openai().completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=6)
    assert raw.response == text.choices[0].text and raw.eval_count == 6
    streamed = "".join(p.response for p in client.generate(model=MODEL, prompt="The capital of France is", raw=True,
                                                           options={**GREEDY, "num_predict": 6}, stream=True))
    assert streamed == raw.response


def test_options_are_honoured(client: ollama.Client) -> None:
    stopped = chat(client, options={**GREEDY, "stop": ["3."]})
    assert "3." not in stopped.message.content and stopped.done_reason == "stop"
    assert "2. 2" in stopped.message.content  # it counted up to the stop
    seeded = [chat(client, options={"temperature": 1.0, "seed": 7, "num_predict": 12}).message.content for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_format_holds_the_answer_to_a_schema_or_to_json(client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    out = chat(client, messages=[{"role": "user", "content": "Name a city as JSON."}], format=schema,
               options={"temperature": 0, "num_predict": 40})
    assert out.done_reason == "stop"
    assert list(json.loads(out.message.content)) == ["city"]
    loose = chat(client, messages=[{"role": "user", "content": "A person as JSON."}], format="json",
                 options={"temperature": 0, "num_predict": 12})
    assert loose.message.content.lstrip().startswith("{")


def test_think_gives_the_reasoning_as_thinking_and_false_turns_it_off(client: ollama.Client) -> None:
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    on = client.chat(model=THINKER, messages=ask, think=True, options=GREEDY)
    assert on.message.thinking and on.message.thinking.strip()
    streamed = list(client.chat(model=THINKER, messages=ask, think=True, options=GREEDY, stream=True))
    assert "".join(p.message.thinking or "" for p in streamed) == on.message.thinking
    off = client.chat(model=THINKER, messages=ask, think=False, options=GREEDY)
    assert not off.message.thinking and off.message.content
    gen = client.generate(model=THINKER, prompt="What is the capital of France?", think="low", options=GREEDY)
    assert gen.thinking and gen.prompt_eval_count > on.prompt_eval_count  # the level went into the prompt


def test_a_tool_round_trips_history_reaches_the_prompt(client: ollama.Client) -> None:
    weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                               "required": ["city"]}}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    history = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"sky": "sunny", "temperature_c": 21}', "tool_name": "get_weather"}]
    alone = client.chat(model=MODEL, messages=ask, tools=[weather], options={"temperature": 0, "num_predict": 1})
    after = client.chat(model=MODEL, messages=history, tools=[weather], options={"temperature": 0, "num_predict": 8})
    assert after.message.content and after.prompt_eval_count > alone.prompt_eval_count + 15


def test_tags_show_ps_and_version_describe_the_models(client: ollama.Client, sup: SupervisorProcess) -> None:
    chat(client)  # loaded now
    listed = {m.model: m for m in client.list().models}
    assert set(listed) == {MODEL, THINKER}
    smol = listed[MODEL]
    assert smol.size and smol.size > 100_000_000 and len(smol.digest or "") == 64
    assert smol.details.family == "llama" and smol.details.parameter_size == "135M"
    shown = client.show(MODEL)
    assert "completion" in (shown.capabilities or []) and shown.details.family == "llama"
    assert shown.modelinfo["general.parameter_count"] > 100_000_000 and shown.modelinfo["llama.context_length"] > 0
    assert "im_start" in (shown.template or "")
    assert "thinking" in (client.show(THINKER).capabilities or [])
    running = {m.model: m for m in client.ps().models}
    assert MODEL in running and running[MODEL].context_length and running[MODEL].expires_at > datetime.now(UTC)
    assert sup.client.get("/api/version").json()["version"].count(".") == 2


def test_keep_alive_sets_when_the_model_unloads(client: ollama.Client) -> None:
    def expires(model: str) -> datetime | None:
        return next((m.expires_at for m in client.ps().models if m.model == model), None)

    loaded = client.chat(model=THINKER, messages=[])  # no messages: load it
    assert loaded.done and loaded.done_reason == "load" and expires(THINKER) is not None
    client.chat(model=THINKER, messages=ASK, options={"num_predict": 2}, keep_alive=-1)
    assert expires(THINKER).year > 2300  # type: ignore[union-attr]
    client.chat(model=THINKER, messages=ASK, options={"num_predict": 2}, keep_alive="10m")
    left = (expires(THINKER) - datetime.now(UTC)).total_seconds()  # type: ignore[operator]
    assert 540 < left <= 600
    gone = client.generate(model=THINKER, prompt="", keep_alive=0)
    assert gone.done_reason == "unload"
    wait_for(lambda: expires(THINKER) is None, 30, message="keep_alive 0 did not unload the model")
    client.chat(model=THINKER, messages=ASK, options={"num_predict": 2})  # back, at the configured idle TTL
    left = (expires(THINKER) - datetime.now(UTC)).total_seconds()  # type: ignore[operator]
    assert 1700 < left <= 1800


BAD: list[tuple[str, str, Any, int, str]] = [
    ("malformed JSON", "/api/chat", b'{"model": "smol", "messages": [', 400, "JSON"),
    ("messages not a list", "/api/chat", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("no model", "/api/chat", {"messages": ASK}, 400, "model"),
    ("unknown model", "/api/chat", {"model": "nope", "messages": ASK}, 404, "nope"),
    ("unknown model, streamed", "/api/generate", {"model": "nope", "prompt": "x", "stream": True}, 404, "nope"),
    ("temperature out of range", "/api/chat", {"model": MODEL, "messages": ASK, "options": {"temperature": 9}}, 400,
     "temperature"),
    ("num_predict 0", "/api/chat", {"model": MODEL, "messages": ASK, "options": {"num_predict": 0}}, 400, "num_predict"),
    ("a think level unknown", "/api/chat", {"model": MODEL, "messages": ASK, "think": "max"}, 400, "think"),
    ("format not json", "/api/chat", {"model": MODEL, "messages": ASK, "format": "yaml"}, 400, "format"),
    ("keep_alive not a duration", "/api/chat", {"model": MODEL, "messages": ASK, "keep_alive": "soon"}, 400, "keep_alive"),
    ("an image to a text model", "/api/chat", {"model": MODEL, "messages": [
        {"role": "user", "content": "x", "images": ["iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg=="]}]},
     400, "images"),
    ("an image that is not one", "/api/generate", {"model": MODEL, "prompt": "x", "images": ["aGVsbG8="]}, 400, "image"),
    ("suffix", "/api/generate", {"model": MODEL, "prompt": "def f(", "suffix": "return 1"}, 400, "suffix"),
    ("show without a model", "/api/show", {}, 400, "model"),
    ("embeddings of a chat model", "/api/embed", {"model": MODEL, "input": ["a", "b"]}, 400,
     f"model {MODEL} is not an embedding model"),
    ("the older embeddings route, a chat model", "/api/embeddings", {"model": MODEL, "prompt": "a"}, 400,
     "not an embedding model"),
    ("embed with a bad body", "/api/embed", {"model": MODEL, "dimensions": 0}, 400, "dimensions"),
    ("show an unknown model", "/api/show", {"model": "nope"}, 404, "nope"),
]


@pytest.mark.parametrize(("path", "body", "status", "says"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests_get_ollamas_error_shape(sup: SupervisorProcess, path: str, body: Any, status: int,
                                              says: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = sup.client.post(path, content=content, headers={"Content-Type": "application/json"})
    assert resp.status_code == status, resp.text
    assert set(resp.json()) == {"error"} and says.lower() in resp.json()["error"].lower(), resp.text


def test_the_client_raises_ollamas_errors(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="nope", messages=ASK)
    assert info.value.status_code == 404 and "nope" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        list(client.chat(model=MODEL, messages=ASK, options={"temperature": 9}, stream=True))
    assert info.value.status_code == 400


def test_a_client_that_leaves_mid_stream_frees_its_row(sup: SupervisorProcess, client: ollama.Client) -> None:
    body = {"model": MODEL, "messages": ASK, "options": {"temperature": 0, "num_predict": 400}}
    with httpx.Client(base_url=sup.url, timeout=60) as c, c.stream("POST", "/api/chat", json=body) as resp:
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        first = json.loads(next(resp.iter_lines()))
        assert first["done"] is False and first["message"]["content"]
    wait_for(lambda: sup.engine_stats(MODEL)["lanes"]["kv_booked_tokens"] == 0, 30,
             message=lambda: f"the row stayed: {sup.engine_stats(MODEL)['lanes']}")
    assert chat(client).done  # and the model serves on


# --- on fake engines: a streamed tool call, a crash mid-stream, keys ---


@pytest.fixture(scope="module")
def tools_fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    proc = fake_supervisor(tmp_path_factory.mktemp("ollama-tools"), "tool_calls")
    yield proc
    proc.stop()


def test_a_streamed_tool_call_comes_whole_with_its_arguments_as_an_object(tools_fake: SupervisorProcess) -> None:
    with ollama.Client(host=tools_fake.url) as c:
        parts = list(c.chat(model="fake", messages=ASK, stream=True))
    calls = [call for p in parts for call in p.message.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == {"city": "Paris"}
    assert parts[-1].done and parts[-1].done_reason == "stop"


@pytest.fixture(scope="module")
def dying(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    config = '[server]\napi_keys = ["sk-a"]\nadmin_keys = ["sk-admin"]\nmax_body_bytes = 65536\n'
    proc = fake_supervisor(tmp_path_factory.mktemp("ollama-fake"), "exit_midway", config=config)
    yield proc
    proc.stop()


def test_an_engine_dying_mid_stream_ends_it_with_an_error_line(dying: SupervisorProcess) -> None:
    with ollama.Client(host=dying.url, headers={"Authorization": "Bearer sk-a"}) as c:
        seen: list[str] = []
        with pytest.raises(ollama.ResponseError) as info:
            for part in c.chat(model="fake", messages=ASK, options={"num_predict": 8}, stream=True):
                seen.append(part.message.content or "")
        assert seen[:3] == ["t0 ", "t1 ", "t2 "] and "restarted" in info.value.error
        again = c.chat(model="fake", messages=ASK, options={"num_predict": 2}, stream=True)
        assert "".join(p.message.content or "" for p in again) == "t0 t1 "


def test_keys_and_sizes_answer_in_ollamas_shape(dying: SupervisorProcess) -> None:
    resp = dying.client.post("/api/chat", json={"model": "fake", "messages": ASK})
    assert resp.status_code == 401 and set(resp.json()) == {"error"}
    resp = dying.client.get("/api/tags", headers={"Authorization": "Bearer sk-a"})  # a user key is enough
    assert resp.status_code == 200 and [m["name"] for m in resp.json()["models"]] == ["fake"]
    big = {"model": "fake", "messages": [{"role": "user", "content": "x" * 100_000}]}
    resp = dying.client.post("/api/chat", json=big, headers={"Authorization": "Bearer sk-a"})
    assert resp.status_code == 413 and set(resp.json()) == {"error"}
    resp = dying.client.get("/api/jobs", headers={"Authorization": "Bearer sk-a"})  # the lab's: an admin key's
    assert resp.status_code == 401
