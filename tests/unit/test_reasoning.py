"""reasoning.py: a think block split out of a reply as it streams, whatever the pieces; a
prompt that ends inside an open block; and the chat reply putting it in reasoning_content."""

from __future__ import annotations

import json
import random

import msgspec
import pytest

from mlxd.engine.chat.reasoning import (
    ReasoningSplitter,
    ThinkMarkers,
    starts_in_reasoning,
    think_markers,
)
from mlxd.engine.chat.tools import check_tools, format_of
from mlxd.engine.http.openai_replies import ChatReply
from mlxd.protocol.events import Done

THINK = ThinkMarkers("<think>", "</think>")


def split(text: str, pieces: list[str], in_reasoning: bool = False) -> tuple[str, str]:
    s = ReasoningSplitter(THINK, in_reasoning)
    parts = [s.feed(p) for p in pieces] + [s.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


CASES = [
    ("<think>\nWhich city?\n</think>\n\nParis.", False, "Which city?\n", "Paris."),
    ("Let me see.\n</think>\n\nParis.", True, "Let me see.\n", "Paris."),
    ("Paris, no thinking.", False, "", "Paris, no thinking."),
    ("a < b and <thin but not a marker", False, "", "a < b and <thin but not a marker"),
    ("<think>cut off before the end", False, "cut off before the end", ""),
    ("all reasoning, prompt opened it", True, "all reasoning, prompt opened it", ""),
]


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), CASES)
def test_the_split_is_the_same_whatever_the_pieces(text: str, inside: bool, reasoning: str, content: str) -> None:
    rng = random.Random(len(text))
    for trial in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, trial)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert split(text, pieces, inside) == (reasoning, content), pieces


def test_markers_are_held_back_until_known() -> None:
    s = ReasoningSplitter(THINK)
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>hmm</th") == ("hmm", "")
    assert s.feed("ink>ok") == ("", "ok")


@pytest.mark.parametrize(("prompt", "inside"), [
    ("<|im_start|>assistant\n<think>\n", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # thinking turned off
    ("<|im_start|>assistant\n<think>old</think>done<|im_end|>\n<|im_start|>assistant\n", False),
    ("<|im_start|>assistant\n", False),
])
def test_a_prompt_ending_inside_an_open_block_is_found(prompt: str, inside: bool) -> None:
    assert starts_in_reasoning(prompt, THINK) is inside


def test_markers_come_from_the_template_when_the_vocabulary_has_none() -> None:
    class Tok:
        has_thinking = False
        chat_template = "{% if x %}<think>{% endif %}</think>"

    assert think_markers(Tok()) == THINK
    Tok.chat_template = "plain"
    assert think_markers(Tok()) is None


def test_the_chat_reply_streams_reasoning_then_a_call() -> None:
    req = check_tools([{"type": "function", "function": {"name": "f"}}], "auto", None)
    reply = ChatReply("id", 0, "m", tool_req=req, markup=format_of(object(), False).markup, think=THINK)
    text = '<think>I should call f.</think>\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    chunks = [c for ch in text for c in reply.text(ch)] + reply.closing(Done("stop", 3, 5))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.reasoning_content or "" for d in deltas) == "I should call f."
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert calls[0]["function"]["name"] == "f" and json.loads(calls[1]["function"]["arguments"]) == {"x": 1}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_whole_message_has_reasoning_content_only_when_there_was_some() -> None:
    reply = ChatReply("id", 0, "m", think=THINK)
    reply.text("<think>hm</think>Paris.")
    message, _ = reply.message(Done("stop", 3, 5))
    assert (message.reasoning_content, message.content) == ("hm", "Paris.")
    plain = ChatReply("id", 0, "m", think=THINK)
    plain.text("Paris.")


    assert "reasoning_content" not in msgspec.json.decode(msgspec.json.encode(plain.message(Done("stop", 3, 5))[0]))
