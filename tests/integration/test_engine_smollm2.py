"""Real text from the imported SmolLM2 through the engine, with the official openai SDK."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support import EngineProcess, openai_client

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(smol_engine: EngineProcess) -> Iterator[openai.OpenAI]:
    with openai_client(smol_engine) as sdk:
        yield sdk


def test_chat_answers_paris(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, max_tokens=24,  # type: ignore[arg-type]
    )
    assert "Paris" in (out.choices[0].message.content or "")
    assert out.choices[0].finish_reason == "stop"  # ends on <|im_end|>, not the budget
    assert out.model == "SmolLM2-135M-Instruct"


def test_streamed_answer_matches_and_stop_string_is_never_sent(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, max_tokens=24,  # type: ignore[arg-type]
    ).choices[0].message.content or ""
    assert "Paris" in full
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, max_tokens=24,  # type: ignore[arg-type]
        stream=True, stop=["Paris"],
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full[: full.index("Paris")]  # nothing of the stop string, not even "P"


def test_developer_role_and_text_parts_work_like_system(client: openai.OpenAI) -> None:
    messages = [
        {"role": "developer", "content": "Answer with one word."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]},
    ]
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=16,  # type: ignore[arg-type]
    )
    assert "Paris" in (out.choices[0].message.content or "")


def test_follow_up_turn_reuses_the_cached_prefix(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, max_tokens=24,  # type: ignore[arg-type]
    )
    answer = first.choices[0].message.content or ""
    follow = [*QUESTION, {"role": "assistant", "content": answer}, {"role": "user", "content": "And of Italy?"}]
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=follow, temperature=0, max_tokens=24,  # type: ignore[arg-type]
    )
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens  # type: ignore[union-attr]
    assert "Rome" in (out.choices[0].message.content or "")


def test_a_text_completion_keeps_the_space_that_continues_the_prompt(client: openai.OpenAI) -> None:
    """ "The capital of France is" goes on with " Paris": the reply's first space is the text's
    (mlx-lm's detokenizer drops it, as a chat reply wants), whole and streamed."""
    out = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=3, temperature=0,
                                    logprobs=1)
    assert out.choices[0].text == "".join(out.choices[0].logprobs.tokens)  # type: ignore[union-attr]
    assert out.choices[0].text.startswith(" Paris")
    streamed = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=3, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text
    echoed = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=3, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text.startswith("The capital of France is Paris")
