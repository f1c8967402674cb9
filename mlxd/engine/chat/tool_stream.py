"""Tool calls out of a model's reply, as the reply streams.

A reply is prose, tool-call markup, or both. `ToolCallStream` is fed the reply's text in
whatever pieces it arrives (a token's worth, or one character at a time) and returns events:
prose as `Content` the moment it cannot be the start of a call any more, and each call as a
`Call` once its markup is complete and parsed. Markup never reaches `Content`, except when it
fails to parse: then the markup itself is returned as content, so nothing the model wrote is
lost.

The markup of a call is the format's start marker, a body, and its end marker (or the end of
the reply, for formats without one). The body is parsed by the format's parser (mlx-lm's
`mlx_lm.tool_parsers`, or mlxd's for Llama 3's bare JSON), which returns one call or a list.

Whitespace between prose and a call, between calls, and after the last call is dropped
(templates put newlines there); whitespace in prose is kept.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Parser = Callable[[str, Any], Any]


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class Call:
    index: int  # 0, 1, ... in the reply
    id: str
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's shape)


Event = Content | Call


@dataclass(frozen=True, slots=True)
class Markup:
    """How one tool format marks a call in the reply."""

    start: str  # "" for a format whose call is a bare JSON object at the start of the reply
    end: str  # "" when a call runs to the end of the reply
    parse: Parser


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def normalize(parsed: Any) -> list[tuple[str, str, str | None]]:
    """(name, arguments as a JSON string, the model's own id) for each call a parser returned;
    ValueError when it is not calls."""
    items = parsed if isinstance(parsed, list) else [parsed]
    if not items:
        raise ValueError("no call")
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise ValueError("a call needs a name")
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                decoded = json.loads(args) if args.strip() else {}
            except ValueError as exc:
                raise ValueError(f"arguments are not JSON: {exc}") from exc
            args = decoded
        if not isinstance(args, dict):
            raise ValueError("arguments must be a JSON object")
        model_id = item.get("id") if isinstance(item.get("id"), str) and item.get("id") else None
        out.append((item["name"], json.dumps(args, ensure_ascii=False), model_id))
    return out


def held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (kept back until known)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolCallStream:
    """Feed it the reply's text; it returns `Content` and `Call` events (see the module doc)."""

    def __init__(self, markup: Markup, tools: Any = None, *, tool_names: set[str] | None = None) -> None:
        self._m = markup
        self._tools = tools
        self._names = tool_names  # when given, a call to another name is content, not a call
        self._buf = ""  # text not yet decided
        self._in_call = False
        self._started = False  # any non-whitespace seen (a bare-JSON call must come first)
        self._ws = ""  # whitespace after the last content, emitted only if more content follows
        self._after_call = False
        self.calls: list[Call] = []

    @property
    def in_call(self) -> bool:
        return self._in_call

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._buf += text
        start, end = self._m.start, self._m.end
        while self._buf:
            if self._in_call:
                if not end:
                    break  # the call runs to the end of the reply
                j = self._buf.find(end)
                if j < 0:
                    break
                body, self._buf = self._buf[:j], self._buf[j + len(end):]
                self._in_call = False
                out += self._close(body, closed=True)
                continue
            if not start:  # bare JSON: a call only if the reply opens with "{"
                if not self._started:
                    stripped = self._buf.lstrip()
                    if not stripped:
                        break
                    self._started = True
                    if stripped.startswith("{") or stripped.startswith("["):
                        self._ws += self._buf[: len(self._buf) - len(stripped)]
                        self._buf = stripped
                        self._in_call = True
                        continue
                out += self._content(self._buf)
                self._buf = ""
                break
            i = self._buf.find(start)
            if i >= 0:
                out += self._content(self._buf[:i])  # its trailing whitespace waits in _ws
                self._buf = self._buf[i + len(start):]
                self._in_call = True
                continue
            keep = held_prefix(self._buf, start)
            out += self._content(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return out

    def finish(self) -> list[Event]:
        """The end of the reply: an open call is parsed as it stands, held text is released."""
        out: list[Event] = []
        if self._in_call:
            self._in_call = False
            body, self._buf = self._buf, ""
            out += self._close(body, closed=False)
        elif self._buf:
            out += self._content(self._buf)
            self._buf = ""
        if self._ws and not self.calls:
            out.append(Content(self._ws))
        self._ws = ""
        return out

    def _content(self, text: str) -> list[Event]:
        if self._after_call:
            text = text.lstrip()  # the template's newlines after a call
        if not text:
            return []
        self._started = True
        self._after_call = False
        body = text.rstrip()
        if not body:
            self._ws += text
            return []
        lead, self._ws = self._ws, text[len(body):]
        return [Content(lead + body)]

    def _close(self, body: str, closed: bool) -> list[Event]:
        raw = self._m.start + body + (self._m.end if closed else "")
        try:
            calls = normalize(self._m.parse(body, self._tools))
            if self._names is not None and any(name not in self._names for name, _, _ in calls):
                raise ValueError("a call to a function the request did not offer")
        except Exception:  # any parser error means: not a call; the markup is content
            self._after_call = False  # (with the whitespace before it)
            return self._content(raw)
        events: list[Event] = []
        for name, args, model_id in calls:
            call = Call(len(self.calls), model_id or new_call_id(), name, args)
            self.calls.append(call)
            events.append(call)
        self._ws = ""  # whitespace before a call is the template's, not prose
        self._after_call = True
        return events
