"""Issue 9 on a real engine: numbers out of range and deep JSON are 400s, queued streams get
keep-alive comments, and `ps` names the engine by its model."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2 as httpx
import psutil
import pytest

from mlxd.engine.http.sse import KEEPALIVE_ENV, keepalive_interval
from tests.support import NO_EOS, EngineProcess, engine_env, openai_client, wait_for

MSG = [{"role": "user", "content": "Hello there"}]
BIG = "1" + "0" * 400  # 10**400: no C integer holds it, and float() of it overflows
DEEP = "[" * 1000 + "]" * 1000
KEEPALIVE_S = 0.2
# The tiny model decodes ~450 tokens/s here: this outlasts every step a test takes while it runs.
HOG = {"prompt": "Hi", "max_tokens": 4000, "temperature": 0, "logit_bias": NO_EOS, "stream": True}


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[EngineProcess]:
    """The tiny model with its full window (room for a long generation), keep-alives every 0.2 s."""
    proc = EngineProcess(tiny_model, "tiny", env=engine_env(MLXD_STREAM_KEEPALIVE_S=str(KEEPALIVE_S)))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def error_of(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error"
    return body["error"]  # type: ignore[no-any-return]


def post_raw(engine: EngineProcess, path: str, body: str) -> httpx.Response:
    return engine.client.post(path, content=body.encode(), headers={"Content-Type": "application/json"})


# ---- numbers out of range, deep JSON: 400s naming the field, never 500s ----


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (f'"top_k": {BIG}', "top_k"),  # was a 500: OverflowError in float()
        (f'"seed": {BIG}', "seed"),
        (f'"max_tokens": {BIG}', "max_tokens"),
        (f'"max_completion_tokens": {BIG}', "max_completion_tokens"),
        (f'"n": {BIG}', "n"),
        (f'"top_logprobs": {BIG}', "top_logprobs"),
        ('"temperature": 1e999', "temperature"),
        (f'"top_p": {BIG}', "top_p"),
        ('"min_p": -1e999', "min_p"),
        ('"presence_penalty": 3', "presence_penalty"),
        ('"repetition_penalty": 1e-300', "repetition_penalty"),
        ('"logit_bias": {"5": 1e999}', "logit_bias[...]"),
        (f'"logit_bias": {{"{BIG}": 1}}', "logit_bias"),
        ('"logit_bias": {"-3": 1}', "logit_bias"),
        ('"stop": "' + "x" * 513 + '"', "stop"),
        (f'"stream": true, "top_k": {BIG}', "top_k"),
    ],
)
def test_chat_numbers_out_of_range_are_400_naming_the_field(engine: EngineProcess, fields: str, param: str) -> None:
    body = f'{{"messages": {json.dumps(MSG)}, {fields}}}'
    assert error_of(post_raw(engine, "/v1/chat/completions", body))["param"] == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [(f'"prompt": "hi", "top_k": {BIG}', "top_k"), (f'"prompt": [{BIG}]', "prompt"),
     ('"prompt": [-1]', "prompt"), ('"prompt": "hi", "best_of": 3', "best_of")],
)
def test_completion_numbers_out_of_range_are_400(engine: EngineProcess, fields: str, param: str) -> None:
    assert error_of(post_raw(engine, "/v1/completions", f"{{{fields}}}"))["param"] == param


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", f'{{"messages": {json.dumps(MSG)}, "chat_template_kwargs": {{"x": {DEEP}}}}}'),
        ("/v1/chat/completions", f'{{"messages": {json.dumps(MSG)}, "tools": [{{"function": {DEEP}}}]}}'),
        ("/v1/completions", f'{{"prompt": {DEEP}}}'),
    ],
)
def test_json_nested_1000_deep_is_400(engine: EngineProcess, path: str, body: str) -> None:
    assert error_of(post_raw(engine, path, body))["code"] == "json_too_deep"  # msgspec's RecursionError was a 500


def test_edge_values_are_served(engine: EngineProcess) -> None:
    edges: list[dict[str, Any]] = [
        {"seed": 2**63 - 1}, {"seed": -(2**63)}, {"top_k": 2**31 - 1}, {"temperature": 2, "min_p": 1},
        {"repetition_penalty": 0.01, "presence_penalty": -2, "frequency_penalty": 2},
    ]
    for extra in edges:
        body = {"messages": MSG, "max_tokens": 3, "logit_bias": NO_EOS, **extra}
        resp = engine.client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, (extra, resp.text)
        assert resp.json()["usage"]["completion_tokens"] == 3


def test_a_tiny_temperature_or_top_p_0_is_greedy_not_noise(engine: EngineProcess) -> None:
    def text(**sampling: float) -> str:
        body = {"prompt": "The quick brown", "max_tokens": 12, "logit_bias": NO_EOS, "seed": 1, **sampling}
        return engine.client.post("/v1/completions", json=body).json()["choices"][0]["text"]  # type: ignore[no-any-return]

    greedy = text(temperature=0)
    # 1/1e-300 overflows float32: every logit became inf or NaN and the sample was noise.
    assert text(temperature=1e-300) == greedy
    # mlx-lm reads top_p=0 as "no top-p", which sampled from the whole vocabulary.
    assert text(temperature=1, top_p=0) == greedy


# ---- keep-alive comments while a stream waits its turn ----


def start_hog(engine: EngineProcess, stack: contextlib.ExitStack) -> tuple[httpx.Response, Iterator[str]]:
    """A long generation that holds the GPU thread until its response is closed (that cancels it)."""
    hog = stack.enter_context(engine.client.stream("POST", "/v1/completions", json=HOG))
    lines = hog.iter_lines()  # kept: a line iterator that is collected closes the response
    assert next(lines).startswith("data: ")  # generating now
    return hog, lines


def num_submitted(engine: EngineProcess) -> int:
    return engine.stats()["requests"]["total"]  # type: ignore[no-any-return]


def read_until_keepalive(lines: Iterator[str]) -> list[str]:
    """Lines of a stream up to its first keep-alive comment (a few keep-alive periods)."""
    seen = [next(lines)]
    while seen[-1] != ": keep-alive":
        seen.append(next(lines))
    return seen


def sdk_stream(engine: EngineProcess) -> list[Any]:
    with openai_client(engine) as client:
        return list(client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0, stream=True))  # type: ignore[arg-type]


def test_a_queued_stream_gets_keepalive_comments_until_its_first_token(engine: EngineProcess) -> None:
    expected = engine.client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 6, "temperature": 0})
    body = {"messages": MSG, "max_tokens": 6, "temperature": 0, "stream": True}
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ThreadPoolExecutor(1))
        http = stack.enter_context(httpx.Client(transport=httpx.HTTPTransport(uds=str(engine.socket)), base_url="http://engine", timeout=60))
        hog, _ = start_hog(engine, stack)
        before = num_submitted(engine)
        # The SDK's request is queued first, so it waits (and gets comments) at least as long as the raw one.
        sdk = pool.submit(sdk_stream, engine)
        assert wait_for(lambda: num_submitted(engine) == before + 1, timeout=30)
        raw = stack.enter_context(http.stream("POST", "/v1/chat/completions", json=body))
        lines = raw.iter_lines()
        head = read_until_keepalive(lines)
        hog.close()  # its job is cancelled: the queued ones run
        events = [line for line in [*head, *lines] if line]
        chunks = sdk.result(timeout=60)
    num_comments = events.index(next(e for e in events if e.startswith("data: ")))
    assert num_comments >= 1 and set(events[:num_comments]) == {": keep-alive"}
    # none once tokens flow, but the usage report before [DONE] (process.USAGE_COMMENT)
    assert all(e.startswith("data: ") for e in events[num_comments:-2]) and events[-2].startswith(": mlxd-usage ")
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[num_comments].removeprefix("data: "))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = expected.json()["choices"][0]["message"]["content"]
    assert "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or "" for e in events[num_comments:-2]) == text
    # The SDK's decoder skips the comments.
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


@pytest.mark.parametrize(("value", "expected"), [(None, 3.0), ("0.5", 0.5), ("0", 3.0), ("-1", 3.0), ("nan", 3.0), ("inf", 3.0), ("x", 3.0)])
def test_keepalive_interval_from_the_environment(value: str | None, expected: float) -> None:
    assert keepalive_interval({} if value is None else {KEEPALIVE_ENV: value}) == expected


def test_a_queued_stream_whose_client_leaves_is_cancelled(engine: EngineProcess) -> None:
    body = {"messages": MSG, "max_tokens": 6, "stream": True}
    cancelled = engine.stats()["requests"]["cancelled"]
    with contextlib.ExitStack() as stack:
        hog, _ = start_hog(engine, stack)
        with engine.client.stream("POST", "/v1/chat/completions", json=body) as queued:
            read_until_keepalive(queued.iter_lines())
        hog.close()
    assert wait_for(lambda: engine.stats()["requests"]["cancelled"] == cancelled + 2, timeout=30)
    assert engine.stats()["requests"]["active"] == 0


# ---- process titles ----


def test_ps_names_the_engine_by_its_model(engine: EngineProcess) -> None:
    # setproctitle overwrites argv's memory and pads it with NULs, which psutil reads as empty args.
    assert [arg for arg in psutil.Process(engine.proc.pid).cmdline() if arg] == ["mlxd engine tiny"]
