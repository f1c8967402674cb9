"""The engine's OpenAI surface on the tiny random model: shapes, streaming, limits, bad input."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import httpx2 as httpx
import msgspec
import openai
import pytest

from mlxd.protocol.stats import EngineHealth
from tests.support import NO_EOS, EngineProcess, openai_client

MSG = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def client(tiny_engine: EngineProcess) -> Iterator[openai.OpenAI]:
    with openai_client(tiny_engine) as sdk:
        yield sdk


def test_health_and_models(tiny_engine: EngineProcess, client: openai.OpenAI) -> None:
    health = tiny_engine.client.get("/health")
    assert health.json() == {"status": "ready", "model": "tiny"}
    assert msgspec.json.decode(health.content, type=EngineHealth).status == "ready"
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_chat_respects_max_tokens_and_reports_usage(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=7, temperature=0)  # type: ignore[arg-type]
    assert out.object == "chat.completion"
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7
    assert out.choices[0].message.role == "assistant"


def test_stream_equals_non_stream_and_ends_with_usage(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=12, temperature=0, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    closing = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert closing.choices[0].delta.content is None and closing.choices[0].delta.role is None
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12


def test_sse_framing_ends_with_bare_done(tiny_engine: EngineProcess) -> None:
    body = {"messages": MSG, "max_tokens": 3, "stream": True}
    with tiny_engine.client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    # The usage comment for the supervisor's request log comes last before [DONE] (process.USAGE_COMMENT).
    assert events[-2].startswith(": mlxd-usage {") and json.loads(events[-2].removeprefix(": mlxd-usage "))
    # Before its first token a stream may carry keepalive comments (every 3 s: a busy machine's
    # first token can take that long); after it, only data events.
    data = list(itertools.dropwhile(lambda e: e.startswith(": "), events[:-2]))
    assert data and all(e.startswith("data: ") for e in data)
    for e in data:
        json.loads(e[len("data: "):])


def test_prefix_reuse_reports_cached_tokens_and_same_output(client: openai.OpenAI) -> None:
    base = [{"role": "system", "content": "You are a careful assistant. " * 8}, *MSG]
    first = client.chat.completions.create(model="tiny", messages=base, max_tokens=5, temperature=0)  # type: ignore[arg-type]
    again = client.chat.completions.create(model="tiny", messages=base, max_tokens=5, temperature=0)  # type: ignore[arg-type]
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content


def test_seed_makes_sampling_repeatable(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str | None:
        out = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=16, temperature=1.0, seed=seed)  # type: ignore[arg-type]
        return out.choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(4)}) > 1


def test_logit_bias_forces_a_token(client: openai.OpenAI) -> None:
    bias = {"70": 100.0}
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0, logit_bias=bias)
    # Echo a prompt of four token-70s: its text is what four forced tokens decode to.
    ref = client.completions.create(model="tiny", prompt=[70] * 4, max_tokens=1, echo=True, logit_bias=bias)
    assert out.choices[0].text
    assert ref.choices[0].text.startswith(out.choices[0].text)


def test_text_completion_stream_and_echo(client: openai.OpenAI) -> None:
    full = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=6, temperature=0)
    parts = list(client.completions.create(model="tiny", prompt="The quick brown", max_tokens=6, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == full.choices[0].text
    echo = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=6, temperature=0, echo=True)
    assert echo.choices[0].text == "The quick brown" + full.choices[0].text
    assert full.object == "text_completion"


def test_legacy_completion_default_budget_is_16(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="Hello", temperature=0)
    assert out.usage is not None and out.usage.completion_tokens == 16


def test_stop_sequence_cuts_output_and_finishes_with_stop(client: openai.OpenAI) -> None:
    full = client.completions.create(model="tiny", prompt="Hello", max_tokens=24, temperature=0).choices[0].text
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2) if full[i : i + 2].strip() and "\ufffd" not in full[i : i + 2])
    cut = full[: full.index(stop)]
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].text == cut
    assert out.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=24, temperature=0, stop=stop, stream=True))
    assert "".join(p.choices[0].text for p in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


# ---- bad input ----


def error_of(resp: httpx.Response) -> dict[str, object]:
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "x"}', "temperature"),
        (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
        (b'{"messages": "hi"}', "messages"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "stop": 3}', "stop"),
        (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}', "messages[0].content[0]"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "n": 17}', "n"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"999999": 1}}', "logit_bias"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"\xc2\xb2": 1}}', "logit_bias"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": "x"}}', "logit_bias[...]"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"chat_template": "x"}}', "chat_template_kwargs"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": false}}', "chat_template_kwargs"),
        (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}', "messages[0].content[0]"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "xtc_threshold": 0.7}', "xtc_threshold"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "xtc_probability": 1.5}', "xtc_probability"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "repetition_context_size": 0}', "repetition_context_size"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "frequency_context_size": "x"}', "frequency_context_size"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "max_power"}', "reasoning_effort"),
    ],
)
def test_bad_chat_fields_are_400_naming_the_field(tiny_engine: EngineProcess, body: bytes, param: str) -> None:
    resp = tiny_engine.client.post("/v1/chat/completions", content=body)
    assert resp.status_code == 400
    assert error_of(resp)["param"] == param


@pytest.mark.parametrize("body", [b"", b"{", b"not json", b"[1, 2]", b"null"])
def test_malformed_bodies_are_400(tiny_engine: EngineProcess, body: bytes) -> None:
    resp = tiny_engine.client.post("/v1/chat/completions", content=body)
    assert resp.status_code == 400
    assert error_of(resp)["type"] == "invalid_request_error"


def test_max_tokens_past_the_window_is_clamped_and_a_prompt_that_fills_it_is_a_400(tiny_engine: EngineProcess) -> None:
    body = {"messages": MSG, "max_tokens": 32000, "logit_bias": NO_EOS}
    resp = tiny_engine.client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["total_tokens"] == 512  # ran to the end of the window
    long_prompt = list(range(3, 300)) * 2
    resp = tiny_engine.client.post("/v1/completions", json={"prompt": long_prompt})
    assert resp.status_code == 400 and "594" in str(error_of(resp)["message"])


def test_unknown_route_and_wrong_method_are_json(tiny_engine: EngineProcess) -> None:
    resp = tiny_engine.client.get("/v1/nope")
    assert resp.status_code == 404
    assert error_of(resp)["code"] == "not_found"
    resp = tiny_engine.client.get("/v1/chat/completions")
    assert resp.status_code == 405
    assert resp.headers["allow"] == "POST"
    error_of(resp)


def test_engine_still_serves_after_bad_input(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2, logit_bias=NO_EOS)  # type: ignore[arg-type]
    assert out.usage is not None and out.usage.completion_tokens == 2


def test_concurrent_requests_queue_and_all_complete(client: openai.OpenAI) -> None:
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"Request number {i}" for i in range(6)]

    def ask(prompt: str) -> str:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone


def test_negative_seed_and_top_k_over_the_vocabulary_are_served(client: openai.OpenAI) -> None:
    for extra in ({"seed": -1}, {"seed": 2**63 - 1}, {"extra_body": {"top_k": 10**9}}):
        out = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3, logit_bias=NO_EOS, **extra)  # type: ignore[arg-type]
        assert out.usage is not None and out.usage.completion_tokens == 3


def test_seed_outside_int64_is_400(tiny_engine: EngineProcess) -> None:
    resp = tiny_engine.client.post("/v1/chat/completions", json={"messages": MSG, "seed": 2**70})
    assert resp.status_code == 400
    assert error_of(resp)["param"] == "seed"


def test_penalties_give_the_same_output_with_a_warm_prompt_cache(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Repeat after me exactly: the cat sat on the mat. " * 3}]
    kwargs = {"model": "tiny", "messages": messages, "max_tokens": 24, "temperature": 0,
              "presence_penalty": 1.5, "frequency_penalty": 1.0, "extra_body": {"repetition_penalty": 1.3}}
    cold = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    warm = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    # Cold: at most the chat template's opening is cached (the engine serves other tests);
    # warm: all of the prompt but its last token.
    assert cold.usage.prompt_tokens_details.cached_tokens < 10
    assert warm.usage.prompt_tokens_details.cached_tokens == warm.usage.prompt_tokens - 1
    assert warm.choices[0].message.content == cold.choices[0].message.content


def test_xtc_changes_a_sampled_answer_and_a_seed_repeats_it(client: openai.OpenAI) -> None:
    kwargs = {"model": "tiny", "messages": MSG, "max_tokens": 12, "temperature": 0.7, "seed": 5, "logit_bias": NO_EOS}
    plain = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    xtc = {"xtc_probability": 1.0, "xtc_threshold": 0.0}  # every step: all but the least likely token excluded
    cut = [client.chat.completions.create(**kwargs, extra_body=xtc) for _ in range(2)]  # type: ignore[call-overload]
    assert cut[0].choices[0].message.content == cut[1].choices[0].message.content  # the seed holds XTC's coin too
    assert cut[0].choices[0].message.content != plain.choices[0].message.content
