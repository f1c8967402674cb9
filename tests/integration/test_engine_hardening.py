"""Issue 9 on a real engine: numbers out of range and deep JSON are 400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from tests.support import NO_EOS, EngineProcess, running_engine

MSG = [{"role": "user", "content": "Hello there"}]
BIG = "1" + "0" * 400  # 10**400: no C integer holds it, and float() of it overflows
DEEP = "[" * 1000 + "]" * 1000


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[EngineProcess]:
    with running_engine(tiny_model, "tiny") as proc:
        yield proc


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
