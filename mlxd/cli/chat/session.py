"""A conversation with one model: send the turns, stream the answer to the screen as it comes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from mlxd.cli.admin.client import AdminClient
from mlxd.cli.chat import images
from mlxd.cli.chat.answer import Answer, Piece
from mlxd.cli.chat.commands import Settings
from mlxd.cli.chat.stream import ChatStream, chat_body
from mlxd.cli.chat.wait import FirstTokenWait

# Control characters a model might write, save newline and tab: on a terminal they could move the
# cursor or start an escape sequence. Piped output is left as the model wrote it.
CONTROLS = dict.fromkeys([*range(0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)])


@dataclass
class Target:
    """The daemon and model to talk to, and the key for it."""

    url: str
    key: str | None
    key_source: str | None
    model: str

    def client(self) -> AdminClient:
        """A JSON client on the same daemon and key (for /v1/models)."""
        return AdminClient(self.url, self.key, self.key_source)


@dataclass
class Conversation:
    """The settings and the turns so far; the system message leads every request. Images go with
    the next question: the files its text names, and those `/image` attached (`pending`)."""

    settings: Settings = field(default_factory=Settings)
    turns: list[dict[str, Any]] = field(default_factory=list)
    pending: list[Path] = field(default_factory=list)

    def user_turn(self, question: str) -> dict[str, Any]:
        """`question` as the next user message, with its images (ImageError for one that cannot go)."""
        text, named = images.split_images(question)
        return {"role": "user", "content": images.content(text, [*self.pending, *named])}

    def messages(self, turn: dict[str, Any]) -> list[dict[str, Any]]:
        """What to send to ask `turn` (a user_turn) next."""
        system = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        return [*system, *self.turns, turn]

    def remember(self, turn: dict[str, Any], answer: Answer) -> None:
        """Keep the turn, as far as the answer got (its images too: follow-ups see them); a turn
        with nothing answered is dropped. The attached images went with it either way."""
        self.pending.clear()
        if answer.text:
            self.turns += [turn, {"role": "assistant", "content": answer.text}]

    def clear(self) -> None:
        self.turns.clear()
        self.pending.clear()

    @property
    def num_turns(self) -> int:
        return len(self.turns) // 2


@dataclass
class AnswerView:
    """Where an answer goes: text on `out`, reasoning dimmed (or marked when unstyled), the stats line on
    `stats` (None: not shown), the spinner on `wait` (None: not shown)."""

    out: Console
    show_reasoning: bool = True
    stats: Console | None = None
    wait: Console | None = None
    _last: str = field(default="\n", init=False)  # the last character written: end the line after it?
    _kind: str | None = field(default=None, init=False)  # what the last piece was: content or reasoning

    def begin(self) -> None:
        self._last, self._kind = "\n", None

    def show(self, piece: Piece) -> None:
        """Print a piece of the answer as it came."""
        if piece.kind == "reasoning" and not self.show_reasoning:
            return
        if piece.kind != self._kind:
            self._switch(piece.kind)
        self._write(piece.text, "dim" if piece.kind == "reasoning" else None)

    def _switch(self, kind: str) -> None:
        """Mark where reasoning starts and ends: a blank line, and words when there is no dim style."""
        is_plain = not self.out.is_terminal
        if self._kind == "reasoning":
            self._write("\n" if self._last == "\n" else "\n\n")
            if is_plain:
                self._write("...done thinking.\n\n")
        if kind == "reasoning" and is_plain:
            self._write("Thinking...\n")
        self._kind = kind

    def _write(self, text: str, style: str | None = None) -> None:
        if self.out.is_terminal:
            text = text.translate(CONTROLS)
        self.out.out(text, end="", style=style, highlight=False)
        self._last = text[-1:] or self._last

    def end_line(self) -> None:
        """A newline unless the answer's text ended with one."""
        if self._last != "\n":
            self._write("\n")

    def finish(self, answer: Answer, interrupted: bool = False) -> None:
        """End the answer's line, show its tool calls, then the stats line."""
        self.end_line()
        for call in answer.tool_calls.values():
            self._write(call.line() + "\n", "dim")
        if self.stats is not None and answer.has_output:
            note = " · stopped" if interrupted else ""
            self.stats.print(answer.stats() + note, style="dim", highlight=False, markup=False, emoji=False)


def stream_answer(target: Target, conversation: Conversation, question: str, view: AnswerView) -> tuple[Answer, bool]:
    """Ask `question`, printing the answer as it streams; the answer and whether Ctrl-C stopped it.

    Errors (an `AdminError`) propagate; a Ctrl-C closes the connection, so the daemon stops generating.
    """
    turn = conversation.user_turn(question)
    body = chat_body(target.model, conversation.messages(turn), conversation.settings.params)
    answer = Answer(started=time.monotonic())
    stream = ChatStream(target.url, target.key)
    wait = FirstTokenWait(view.wait, target.client(), target.model).start() if view.wait is not None else None
    view.begin()
    try:
        for chunk in stream.open(body):
            pieces = answer.feed(chunk, time.monotonic())
            if wait is not None and answer.first_at is not None:
                wait.stop()
            for piece in pieces:
                view.show(piece)
    except KeyboardInterrupt:
        conversation.remember(turn, answer)
        return answer, True
    finally:
        if wait is not None:
            wait.stop()
        stream.close()
    conversation.remember(turn, answer)
    return answer, False
