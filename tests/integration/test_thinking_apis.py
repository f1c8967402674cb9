"""A model that thinks, through the supervisor's translated APIs: SmolLM2 with a fixture chat
template whose generation prompt opens a think block (Qwen3 style, as in test_reasoning.py),
so its reply is reasoning. Anthropic's `thinking` gives thinking blocks (whole and streamed
as `thinking_delta`s); the Responses API gives a reasoning item (whole and streamed), and a
chained turn passes it back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import THINKING_TEMPLATE, SupervisorProcess, model_with_template

MODEL = "smol-think"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def sup(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    root = tmp_path_factory.mktemp("thinking-apis")
    model = model_with_template(smollm2, root / MODEL, THINKING_TEMPLATE)
    proc = SupervisorProcess(f'[models.{MODEL}]\npath = "{model}"\n', root / "data").wait_up()
    yield proc
    proc.stop()


def test_anthropic_thinking_blocks_whole_and_streamed(sup: SupervisorProcess) -> None:
    client = sup.anthropic()
    kw = {"model": MODEL, "max_tokens": 16, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024},
          "extra_body": {"temperature": 0}}
    msg = client.messages.create(**kw)  # type: ignore[arg-type]
    assert msg.content[0].type == "thinking" and msg.content[0].thinking.strip()
    with client.messages.stream(**kw) as stream:  # type: ignore[arg-type]
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas and set(deltas) == {"thinking_delta"}
    assert final.content[0].type == "thinking" and final.content[0].thinking == msg.content[0].thinking


def test_responses_reasoning_items_whole_streamed_and_chained(sup: SupervisorProcess) -> None:
    client = sup.openai()
    kw = {"model": MODEL, "input": ASK, "max_output_tokens": 16, "temperature": 0, "reasoning": {"effort": "low"}}
    out = client.responses.create(**kw)  # type: ignore[arg-type]
    (item,) = [o for o in out.output if o.type == "reasoning"]
    assert item.content and item.content[0].text.strip()
    with client.responses.stream(**kw) as stream:  # type: ignore[arg-type]
        kinds = [e.type for e in stream]
    assert "response.reasoning_text.delta" in kinds
    chained = client.responses.create(model=MODEL, input="And of Italy?", previous_response_id=out.id,
                                      max_output_tokens=4, temperature=0, reasoning={"effort": "low"})
    assert chained.status in ("completed", "incomplete")
    assert chained.usage.input_tokens > out.usage.input_tokens  # the first turn, its reasoning too, came first
