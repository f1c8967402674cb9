"""`mlxd run`'s slash commands and settings, as pure functions of the typed line.

`/bye`, `/clear`, `/set system TEXT`, `/set parameter NAME VALUE`, `/show`, `/?` and
triple-quoted blocks, as ollama's `run` has them, and `/image PATH`; tests/unit/test_run_cmd.py
covers them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

QUOTES = '"""'


class CommandError(ValueError):
    """A slash command that cannot be done; `str()` is the line to show."""


def bounded(kind: type, low: float | None = None, high: float | None = None) -> Callable[[str], Any]:
    """A parser for a number of `kind` within [low, high]; CommandError otherwise."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise CommandError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (low is None or value >= low) or not (high is None or value <= high):  # NaN fails both
            span = f"at least {low:g}" if high is None else f"between {low:g} and {high:g}"
            raise CommandError(f"must be {span}, not {text}")
        return value

    return parse


# name -> parser; the request field has the same name.
PARAMETERS: dict[str, Callable[[str], Any]] = {
    "temperature": bounded(float, 0.0, 2.0),
    "top_p": bounded(float, 0.0, 1.0),
    "max_tokens": bounded(int, 1, 2**31 - 1),
    "seed": bounded(int, -(2**63), 2**63 - 1),
}

HELP = """\
Available commands:
  /set parameter NAME VALUE   set temperature, top_p, max_tokens or seed
  /set system TEXT            set the system message
  /image PATH                 send an image with the next message (or write its path in the message)
  /show                       show the model and the settings
  /clear                      forget the conversation
  /bye                        exit (also Ctrl + d)
  /?, /help                   this help

Use \"\"\" to begin and end a message of several lines, or Alt + Enter (Esc, Enter) for a new line.
Ctrl + c stops an answer."""


@dataclass
class Settings:
    """What each request carries besides the conversation: the system message and sampling parameters."""

    system: str | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def describe(self, model: str, num_turns: int) -> str:
        """The `/show` text."""
        params = ", ".join(f"{k} {v}" for k, v in sorted(self.params.items())) or "the model's defaults"
        return "\n".join([f"model: {model}", f"system: {self.system or '(none)'}", f"parameters: {params}",
                          f"conversation: {num_turns} turn{'s' if num_turns != 1 else ''}"])


@dataclass(frozen=True)
class Command:
    """A parsed slash command: `verb` is bye, clear, show, help, system, parameter or image."""

    verb: str
    name: str = ""
    value: Any = None


SIMPLE = {"/bye": "bye", "/exit": "bye", "/clear": "clear", "/show": "show", "/?": "help", "/help": "help"}


def is_command(text: str) -> bool:
    """Whether a typed line is a slash command rather than a message."""
    return text.lstrip().startswith("/")


def parse_command(text: str) -> Command:
    """The command a `/...` line asks for; CommandError with what to type instead."""
    words = text.strip().split(maxsplit=2)
    head = words[0].lower()
    if head in SIMPLE and len(words) == 1:
        return Command(SIMPLE[head])
    if head == "/set":
        return parse_set(words[1:])
    if head == "/image":
        if len(words) == 1:
            raise CommandError("Usage: /image PATH")
        return Command("image", value=text.strip()[len(words[0]):].strip())
    if head in SIMPLE:
        raise CommandError(f"{head} takes no arguments")
    raise CommandError(f"Unknown command '{words[0]}'. Type /? for help")


def parse_set(words: list[str]) -> Command:
    """`/set system TEXT` or `/set parameter NAME VALUE`."""
    what = words[0].lower() if words else ""
    if what == "system":
        text = unquote(words[1]) if len(words) > 1 else ""
        if not text:
            raise CommandError("Usage: /set system TEXT")
        return Command("system", value=text)
    if what == "parameter":
        return parse_parameter(words[1].split() if len(words) > 1 else [])
    raise CommandError("Usage: /set system TEXT, or /set parameter NAME VALUE")


def parse_parameter(words: list[str]) -> Command:
    """NAME VALUE for `/set parameter`, checked."""
    names = ", ".join(PARAMETERS)
    if len(words) != 2:
        raise CommandError(f"Usage: /set parameter NAME VALUE (NAME is one of {names})")
    name, text = words[0].lower(), words[1]
    if name not in PARAMETERS:
        raise CommandError(f"Unknown parameter '{words[0]}': use one of {names}")
    try:
        return Command("parameter", name, PARAMETERS[name](text))
    except CommandError as exc:
        raise CommandError(f"{name}: {exc}") from None


def unquote(text: str) -> str:
    """TEXT without one pair of surrounding quotes, as `/set system "Be brief."` is often typed."""
    text = text.strip()
    for quote in (QUOTES, '"', "'"):
        if len(text) >= 2 * len(quote) and text.startswith(quote) and text.endswith(quote):
            return text[len(quote) : -len(quote)].strip()
    return text


def opens_block(text: str) -> bool:
    """Whether a typed line begins a `\"\"\"` block."""
    return text.lstrip().startswith(QUOTES)


def closed_block(lines: list[str]) -> str | None:
    """The message once the `\"\"\"` block in `lines` is closed, else None (read another line)."""
    body = "\n".join(lines).lstrip()[len(QUOTES) :]
    if not body.rstrip().endswith(QUOTES):
        return None
    return body.rstrip()[: -len(QUOTES)].strip("\n")
