"""Log probabilities through a real SmolLM2 engine with the openai SDK: chat `logprobs` and
`top_logprobs` (whole and streamed, one request and several at once in the batch lane) and
the legacy completions `logprobs`; out-of-range values are 400s naming the field."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.support import EngineProcess

ASK = [{"role": "user", "content": "What is the capital of France?"}]


def chat(smol_batch_client: openai.OpenAI, **kw: Any) -> Any:
    return smol_batch_client.chat.completions.create(**{"model": "smol", "messages": ASK, "temperature": 0, "max_tokens": 12, **kw})


def check_tokens(content: str, tokens: list[Any], top: int) -> None:
    assert "".join(t.token for t in tokens).strip() == content.strip()
    for t in tokens:
        assert t.logprob <= 0 and t.bytes == list(t.token.encode())
        assert len(t.top_logprobs) == top
        values = [x.logprob for x in t.top_logprobs]
        assert values == sorted(values, reverse=True)
        if top:  # greedy: the chosen token is the likeliest
            assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)


def test_chat_logprobs_with_alternatives(smol_batch_client: openai.OpenAI) -> None:
    out = chat(smol_batch_client, logprobs=True, top_logprobs=3)
    check_tokens(out.choices[0].message.content, out.choices[0].logprobs.content, 3)


def test_chat_logprobs_without_alternatives_and_none_unasked(smol_batch_client: openai.OpenAI) -> None:
    out = chat(smol_batch_client, logprobs=True)
    check_tokens(out.choices[0].message.content, out.choices[0].logprobs.content, 0)
    assert chat(smol_batch_client).choices[0].logprobs is None


def test_streamed_logprobs_cover_the_streamed_text(smol_batch_client: openai.OpenAI) -> None:
    chunks = [c for c in chat(smol_batch_client, logprobs=True, top_logprobs=2, stream=True) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    check_tokens(content, tokens, 2)
    assert content == chat(smol_batch_client).choices[0].message.content


def test_rows_of_the_batch_lane_each_get_their_own(smol_batch_client: openai.OpenAI) -> None:
    questions = ["What is the capital of France?", "What is 2+2?", "Name a color.", "Say hello."]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda q: chat(smol_batch_client, messages=[{"role": "user", "content": q}], logprobs=True,
                                            top_logprobs=1), questions))
    for out in outs:
        check_tokens(out.choices[0].message.content, out.choices[0].logprobs.content, 1)


def test_completions_logprobs_in_the_legacy_shape(smol_batch_client: openai.OpenAI) -> None:
    out = smol_batch_client.completions.create(model="smol", prompt="The capital of France is", temperature=0, max_tokens=6, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens).strip() == out.choices[0].text.strip()
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": ASK, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": ASK, "logprobs": "yes"}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 6}, "logprobs"),
])
def test_bad_logprobs_values_get_a_400(smol_batch_engine: EngineProcess, path: str, body: dict[str, Any], param: str) -> None:
    resp = smol_batch_engine.client.post(path, json={"max_tokens": 2, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
