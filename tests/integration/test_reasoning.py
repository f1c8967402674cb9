"""Reasoning through a real engine with the openai SDK: SmolLM2 with a fixture chat template
whose generation prompt opens a think block (Qwen3 style), so the whole reply is reasoning
(`reasoning_content`, streamed as `delta.reasoning_content`); `chat_template_kwargs`
`enable_thinking: false` reaches the template and the reply is content again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support import THINKING_TEMPLATE, model_with_template, openai_client, running_engine

ASK = [{"role": "user", "content": "What is the capital of France?"}]
# mlx-lm passes enable_thinking = whether the vocabulary has think tokens (SmolLM2's has none)
THINK = {"chat_template_kwargs": {"enable_thinking": True}}


@pytest.fixture(scope="module")
def client(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    model = model_with_template(smollm2, tmp_path_factory.mktemp("smol-think") / "smol-think", THINKING_TEMPLATE)
    with running_engine(model, "smol-think") as engine, openai_client(engine) as sdk:
        yield sdk


def test_a_reply_inside_an_open_think_block_is_reasoning(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="smol-think", messages=ASK, temperature=0, max_tokens=16,  # type: ignore[arg-type]
                                         extra_body=THINK)
    message = out.choices[0].message
    reasoning = getattr(message, "reasoning_content", None)
    assert reasoning and reasoning.strip()  # SmolLM2 never closes the block: all of it is reasoning
    assert message.content == ""
    assert "<think>" not in reasoning


def test_reasoning_streams_as_its_own_delta_and_matches(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="smol-think", messages=ASK, temperature=0, max_tokens=16,  # type: ignore[arg-type]
                                           extra_body=THINK)
    stream = client.chat.completions.create(model="smol-think", messages=ASK, temperature=0, max_tokens=16,  # type: ignore[arg-type]
                                            stream=True, extra_body=THINK)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert streamed == getattr(whole.choices[0].message, "reasoning_content", None)
    assert "".join(d.content or "" for d in deltas) == ""


def test_enable_thinking_false_reaches_the_template_and_the_reply_is_content(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="smol-think", messages=ASK, temperature=0, max_tokens=16,  # type: ignore[arg-type]
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = out.choices[0].message
    assert message.content and message.content.strip()
    assert getattr(message, "reasoning_content", None) is None


def test_reasoning_effort_reaches_the_template(client: openai.OpenAI) -> None:
    def rendered(**extra: object) -> str:
        out = client.post("/chat/render", body={"messages": ASK, **extra}, cast_to=object)
        assert isinstance(out, dict)
        return str(out["text"])

    assert "Reasoning: low" in rendered(reasoning_effort="low")
    assert "Reasoning:" not in rendered()
    # chat_template_kwargs, the more specific, wins over the field
    assert "Reasoning: high" in rendered(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})


def test_reasoning_effort_gates_thinking_and_a_bad_one_is_a_400(client: openai.OpenAI) -> None:
    def ask(effort: str, **extra: object) -> object:
        return client.chat.completions.create(model="smol-think", messages=ASK, temperature=0, max_tokens=12,  # type: ignore[arg-type]
                                              reasoning_effort=effort, **extra)  # type: ignore[arg-type]

    off = ask("none").choices[0].message  # type: ignore[attr-defined]
    assert off.content and getattr(off, "reasoning_content", None) is None  # "none": the template's thinking off
    on = ask("low").choices[0].message  # type: ignore[attr-defined]
    assert on.reasoning_content and on.content == ""  # a level turns it on (SmolLM2's vocabulary alone would not)
    # the reasoning also under `reasoning`, whole and streamed (the reference's and several clients' field)
    assert on.reasoning == on.reasoning_content
    deltas = [c.choices[0].delta for c in ask("low", stream=True) if c.choices]  # type: ignore[attr-defined]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == on.reasoning_content
    with pytest.raises(openai.BadRequestError) as info:
        ask("extreme")
    assert info.value.body["param"] == "reasoning_effort"  # type: ignore[index]
