"""One answer of `mlxd run` as it streams: its text, reasoning, tool calls, timings and stats line."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field

from mlxd.cli.chat.stream import Chunk, Usage

TOOL_LINE_MAX_CHARS = 120


@dataclass
class Piece:
    """Text to show: `kind` is "content" or "reasoning"."""

    kind: str
    text: str


@dataclass
class ToolCall:
    """A tool call put together from its deltas."""

    name: str = ""
    arguments: str = ""

    def line(self) -> str:
        """The short line that shows it."""
        args = self.arguments
        with contextlib.suppress(ValueError):  # shown as sent when it is not JSON
            args = json.dumps(json.loads(args), separators=(",", ":"))
        text = f"tool call: {self.name}({args})"
        return text if len(text) <= TOOL_LINE_MAX_CHARS else text[: TOOL_LINE_MAX_CHARS - 1] + "…"


@dataclass
class Answer:
    """The answer so far; `feed()` each chunk with the time it arrived."""

    started: float
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, ToolCall] = field(default_factory=dict)
    first_at: float | None = None
    last_at: float | None = None
    usage: Usage | None = None
    finish_reason: str | None = None
    num_deltas: int = 0  # chunks that carried text or a call: about one a token

    def feed(self, chunk: Chunk, now: float) -> list[Piece]:
        """Take a chunk in; the text it adds, in order."""
        if chunk.usage is not None:
            self.usage = chunk.usage
        pieces: list[Piece] = []
        for choice in chunk.choices[:1]:
            delta = choice.delta
            if delta.reasoning_content:
                self.reasoning.append(delta.reasoning_content)
                pieces.append(Piece("reasoning", delta.reasoning_content))
            if delta.content:
                self.content.append(delta.content)
                pieces.append(Piece("content", delta.content))
            for call in delta.tool_calls or ():
                self._add_call(call.index, call.function.name if call.function else None,
                               call.function.arguments if call.function else None)
            if pieces or delta.tool_calls:
                self.num_deltas += 1
                self.first_at = self.first_at if self.first_at is not None else now
                self.last_at = now
            self.finish_reason = choice.finish_reason or self.finish_reason
        return pieces

    def _add_call(self, index: int, name: str | None, arguments: str | None) -> None:
        call = self.tool_calls.setdefault(index, ToolCall())
        call.name += name or ""
        call.arguments += arguments or ""

    @property
    def text(self) -> str:
        """The answer's content so far."""
        return "".join(self.content)

    @property
    def has_output(self) -> bool:
        """Whether anything of the answer was shown."""
        return bool(self.content or self.reasoning or self.tool_calls)

    def stats(self) -> str:
        """`12 tokens · 48.1 tokens/s · first token 210 ms`: the line after an answer.

        tokens/s is the decode rate: the tokens after the first over the time since it came. An
        answer cut short has no usage chunk: its count is the chunks that carried text (~).
        """
        if self.usage is not None:
            num_tokens, count = self.usage.completion_tokens, str(self.usage.completion_tokens)
        else:
            num_tokens, count = self.num_deltas, f"~{self.num_deltas}"
        parts = [f"{count} token{'s' if num_tokens != 1 else ''}"]
        if num_tokens > 1 and self.first_at is not None and self.last_at is not None and self.last_at > self.first_at:
            parts.append(f"{(num_tokens - 1) / (self.last_at - self.first_at):.1f} tokens/s")
        if self.first_at is not None:
            parts.append(f"first token {format_duration(self.first_at - self.started)}")
        return " · ".join(parts)


def format_duration(seconds: float) -> str:
    """210 ms, 3.4 s, 2 m 05 s."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes} m {rest:02d} s"
