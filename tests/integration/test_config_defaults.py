"""Request defaults from mlxd's config (`[defaults]`, `[models.NAME.defaults]`) through a real
supervisor and SmolLM2 engine: a request that sets none gets them (over the model's
generation_config.json), a request's own values win, /v1/models shows them, and `thinking`
sets the template's enable_thinking."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support import THINKING_TEMPLATE, SupervisorProcess, model_with_template

MODEL = "think"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def sup(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    root = tmp_path_factory.mktemp("config-defaults")
    model = model_with_template(smollm2, root / MODEL, THINKING_TEMPLATE)
    toml = (f'[defaults]\ntemperature = 0.0\nmax_tokens = 6\n\n[models.{MODEL}]\npath = "{model}"\n'
            f'[models.{MODEL}.defaults]\nthinking = false\ntop_k = 7\n')
    proc = SupervisorProcess(toml, root / "data").wait_up()
    yield proc
    proc.stop()


def test_a_request_that_sets_nothing_gets_the_configs_defaults(sup: SupervisorProcess) -> None:
    client = sup.openai()
    first = client.chat.completions.create(model=MODEL, messages=ASK)  # type: ignore[arg-type]
    again = client.chat.completions.create(model=MODEL, messages=ASK)  # type: ignore[arg-type]
    assert first.usage.completion_tokens == 6 and first.choices[0].finish_reason == "length"  # [defaults] max_tokens
    assert first.choices[0].message.content == again.choices[0].message.content  # temperature 0: greedy
    assert first.choices[0].message.content and getattr(first.choices[0].message, "reasoning_content", None) is None
    text = client.completions.create(model=MODEL, prompt="The capital of France is")
    assert text.usage.completion_tokens == 6  # over the completions route's own 16
    listed = {m.id: m for m in client.models.list().data}
    shown = listed[MODEL].sampling  # type: ignore[attr-defined]
    assert shown["temperature"] == 0.0 and shown["top_k"] == 7.0  # [models.NAME.defaults] over [defaults]


def test_a_requests_own_values_win(sup: SupervisorProcess) -> None:
    client = sup.openai()
    short = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3)  # type: ignore[arg-type]
    assert short.usage.completion_tokens == 3
    thinking = client.chat.completions.create(model=MODEL, messages=ASK,  # type: ignore[arg-type]
                                              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert thinking.choices[0].message.reasoning_content  # type: ignore[attr-defined]
    effort = client.chat.completions.create(model=MODEL, messages=ASK, reasoning_effort="low")  # type: ignore[arg-type]
    assert effort.choices[0].message.reasoning_content  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK, temperature=5)  # type: ignore[arg-type]
