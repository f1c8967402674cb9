"""Reasoning out of a reply: `<think>...</think>` (and the model-specific markers mlx-lm
knows) becomes `reasoning_content`, the rest `content`.

The markers are mlx-lm's for the model (`TokenizerWrapper.think_start` / `think_end`, found
from its vocabulary), else `<think>`/`</think>` when the chat template writes them. A
template whose prompt ends inside an open think block (Qwen3 and DeepSeek-R1 style, where the
generation prompt ends with `<think>`) starts the reply in reasoning. Text that might be the
start of a marker is held back until it is known not to be one, so markers never leak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxd.engine.chat.tool_stream import held_prefix


@dataclass(frozen=True, slots=True)
class ThinkMarkers:
    start: str
    end: str


def think_markers(tokenizer: Any) -> ThinkMarkers | None:
    """The model's think markers, or None when it has none."""
    if getattr(tokenizer, "has_thinking", False) and tokenizer.think_start and tokenizer.think_end:
        return ThinkMarkers(tokenizer.think_start, tokenizer.think_end)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "<think>" in template and "</think>" in template:
        return ThinkMarkers("<think>", "</think>")
    return None


def starts_in_reasoning(prompt_text: str, markers: ThinkMarkers | None) -> bool:
    """Whether the rendered prompt ends inside an open think block."""
    if markers is None:
        return False
    tail = prompt_text.rstrip()
    i = tail.rfind(markers.start)
    return i >= 0 and i >= len(tail) - 200 and i > tail.rfind(markers.end)


class ReasoningSplitter:
    """Feed it the reply's text; it returns (reasoning, content) pieces."""

    def __init__(self, markers: ThinkMarkers, in_reasoning: bool = False) -> None:
        self._m = markers
        self._in = in_reasoning
        self._buf = ""
        self._after_end = False  # strip the whitespace a template puts after the block
        self._fresh = in_reasoning  # strip the newline right after the start marker

    def feed(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        self._buf += text
        while self._buf:
            marker = self._m.end if self._in else self._m.start
            i = self._buf.find(marker)
            if i >= 0:
                self._emit(self._buf[:i], reasoning, content)
                self._buf = self._buf[i + len(marker):]
                self._in = not self._in
                self._fresh = self._in
                self._after_end = not self._in
                continue
            keep = held_prefix(self._buf, marker)
            self._emit(self._buf[: len(self._buf) - keep], reasoning, content)
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        self._emit(self._buf, reasoning, content)
        self._buf = ""
        return "".join(reasoning), "".join(content)

    def _emit(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if self._in:
            if self._fresh:
                text = text.lstrip("\n")
                self._fresh = not text
            reasoning.append(text)
        else:
            if self._after_end:
                text = text.lstrip()
                self._after_end = not text
            content.append(text)
