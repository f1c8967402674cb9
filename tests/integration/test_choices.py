"""`n` > 1 choices through a real SmolLM2 engine with the openai SDK: n rows of the batch
lane, each choice with its index, whole and streamed, usage counting the prompt once; seeded
choices differ from one another and repeat with the seed."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.support import EngineProcess, wait_for

ASK = [{"role": "user", "content": "Tell me a fun fact."}]


def chat(smol_batch_client: openai.OpenAI, **kw: Any) -> Any:
    return smol_batch_client.chat.completions.create(**{"model": "smol", "messages": ASK, "max_tokens": 12, **kw})


def test_two_greedy_choices_are_the_same_answer_with_their_indexes(smol_batch_client: openai.OpenAI) -> None:
    one = chat(smol_batch_client, temperature=0)
    two = chat(smol_batch_client, temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert {c.message.content for c in two.choices} == {one.choices[0].message.content}
    assert two.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens


def test_seeded_choices_differ_and_repeat_with_the_seed(smol_batch_client: openai.OpenAI) -> None:
    a = [c.message.content for c in chat(smol_batch_client, temperature=1.0, seed=7, n=3).choices]
    b = [c.message.content for c in chat(smol_batch_client, temperature=1.0, seed=7, n=3).choices]
    assert a == b
    assert len(set(a)) > 1


def test_streamed_choices_carry_their_index_and_match(smol_batch_client: openai.OpenAI) -> None:
    whole = chat(smol_batch_client, temperature=1.0, seed=3, n=3)
    chunks = list(chat(smol_batch_client, temperature=1.0, seed=3, n=3, stream=True, stream_options={"include_usage": True}))
    texts = {i: "" for i in range(3)}
    finishes = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert set(finishes) == {0, 1, 2}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_a_400(smol_batch_engine: EngineProcess, n: int) -> None:
    resp = smol_batch_engine.client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, "n": n})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"


def test_completions_keep_one_choice(smol_batch_engine: EngineProcess) -> None:
    resp = smol_batch_engine.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"


LONG = [{"role": "user", "content": "Here are my notes. " + " ".join(f"Item {i} is a {w}." for i, w in
                                                                     enumerate(["cat", "dog", "hat", "cup"] * 20))
         + " Which item is first?"}]


def cached_tokens(engine: EngineProcess) -> int:
    return int(engine.stats()["tokens"]["cached"])


def test_choices_share_one_prefill_of_the_prompt(smol_batch_engine: EngineProcess, smol_batch_client: openai.OpenAI) -> None:
    """A prompt longer than a prefill chunk (512 tokens), new to the engine: it runs once, and
    the other two choices start from its KV; greedy, all three give the answer a lone request does."""
    before = cached_tokens(smol_batch_engine)
    three = chat(smol_batch_client, messages=LONG, temperature=0, n=3, max_tokens=8)
    prompt = three.usage.prompt_tokens
    assert prompt > 512
    assert cached_tokens(smol_batch_engine) - before >= 2 * (prompt - 1)  # two choices did not prefill it again
    one = chat(smol_batch_client, messages=LONG, temperature=0, max_tokens=8)
    assert [c.message.content for c in three.choices] == [one.choices[0].message.content] * 3


def test_choices_whose_client_left_during_the_shared_prefill_free_the_engine(
    smol_batch_engine: EngineProcess, smol_batch_client: openai.OpenAI
) -> None:
    """A client gone while its choices wait for their shared prefill: they end, and the engine
    serves the next request at once (no row or KV left booked)."""
    messages = [{"role": "user", "content": LONG[0]["content"] + " Answer briefly."}]
    with pytest.raises(openai.APITimeoutError):
        chat(smol_batch_client.with_options(timeout=0.3, max_retries=0), messages=messages, n=4, max_tokens=64)
    assert chat(smol_batch_client, max_tokens=2).choices[0].finish_reason in ("length", "stop")

    def idle() -> bool:  # the GPU thread releases a row's KV just after its answer went out
        lanes = smol_batch_engine.stats()["lanes"]
        return bool(lanes["batch"] == 0 and lanes["kv_booked_tokens"] == 0)

    assert wait_for(idle, timeout=5.0), smol_batch_engine.stats()["lanes"]
