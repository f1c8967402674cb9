"""What a stream needs to go on when its engine dies: the reply's token ids, from the engine's
resume marks, and the continuation's body (docs/resume.md).

A stream asks its engine for marks (process.MARKS_HEADER). Each write of the engine's stream
then ends with `: ids INDEX TOTAL ID,...`: the token ids the events before it carried. A write is
one HTTP chunk, so the relay sees a mark with its events or neither. `ReplyMarks.take` strips
the mark from each payload before the caller sees it and keeps its ids, bounded. When the engine
dies mid-stream (its connection lost, or a drain's timeout cut the reply short), the
relay raises `Cut`; serve.py then queues the request again with `resume` (the ids, how they
were split, the reply's id and `created`) added to its body, and the new engine's stream goes on
in the same response, its opening events not sent again. A stream cut before its first mark is
sent again as it was. An `n` > 1 chat stream's marks name their choice (INDEX, and ` end` once
the choice's finish_reason went out); each choice's ids are kept apart, and the continuation
carries them as `resume.choices`.
"""

from __future__ import annotations

import array
import time
from typing import Any

import msgspec
from aiohttp import web

from mlxd.protocol.process import MARK, REPLY_HEADER

MAX_KEPT_TOKENS = 1 << 20  # a reply longer than this is not continued (8 MB of ids and splits kept)
MAX_CHOICES = 16  # the most choices (n) a chat request has (protocol/openai.py)
# The engine's error codes when a drain's timeout, a shutdown or its GPU thread's death (the
# engine ends: an engine group's rank gone mid-step ends it so) cut a reply short, or a batched
# step that ran out of device memory did (the engine serves on, its memory given back)
OUT_OF_MEMORY = b'"engine_out_of_memory"'
CUT_CODES = (b'"drain_timeout"', b'"engine_stopping"', b'"engine_failed"', OUT_OF_MEMORY)
DONE = b"data: [DONE]\n\n"
ERROR = b'data: {"error"'


class Cut(Exception):
    """The engine went away mid-answer, and the request may go on (or start over) on another."""

    def __init__(self, response: web.StreamResponse | None) -> None:
        super().__init__()
        self.response = response  # the caller's stream, once open


class Choice:
    """One choice's part of the marks: its token ids, how many each mark named, whether it ended."""

    __slots__ = ("ended", "ids", "segments")

    def __init__(self) -> None:
        self.ids = array.array("q")
        self.segments = array.array("l")
        self.ended = False  # its closing chunks went out (an `n` > 1 stream's mark said ` end`)


class ReplyMarks:
    """One streamed request's resume state, across its engines."""

    def __init__(self) -> None:
        self.choices: dict[int, Choice] = {}  # by index: one for a reply, `n` for an n > 1 chat stream
        self.kept = 0  # ids kept, all choices
        self.reply: tuple[str, int] | None = None  # its id and `created` (REPLY_HEADER)
        self.finished = False  # [DONE] went out: nothing to go on with
        self.stopping = False  # the engine's stream ended with a drain's or shutdown's error: cut short
        self.out_of_memory = False  # the cut now seen was a batched step's want of device memory
        self.broken = False  # a mark that did not add up, or too many ids: the stream can only fail
        self.opened = False  # a translated stream's opening events went out (they are not sent twice)
        self.cuts = 0  # times the request went on after a cut
        self.cut_at: float | None = None  # when the first cut since the reply last went on was seen (perf_counter)
        # Each wait's added latency: from a cut to the next engine's first words (cuts back to back
        # before any words are one wait)
        self.latencies_ms: list[float] = []
        self.gave_up = False  # cut once more than the request may go on

    @property
    def ids(self) -> array.array[int]:
        """The reply's token ids (its first choice's), as its marks named them."""
        return self.choices[0].ids if 0 in self.choices else array.array("q")

    @property
    def segments(self) -> array.array[int]:
        """How many ids each of its marks named."""
        return self.choices[0].segments if 0 in self.choices else array.array("l")

    @property
    def started(self) -> bool:
        """Whether the caller has the reply's opening: the engine's first write came with a mark."""
        return bool(self.choices)

    def head(self, headers: dict[str, str]) -> None:
        """The engine's answer head: the reply's id and `created`."""
        rid, _, created = headers.get(REPLY_HEADER.lower(), "").partition(" ")
        if rid and created.isdigit():
            self.reply = (rid, int(created))

    def take(self, payload: bytes) -> bytes:
        """`payload` without its mark (whose ids are kept). An error event after the mark ends
        the stream: one that says a drain or shutdown cut the reply short is taken out (the
        caller does not see it: the reply goes on elsewhere); any other stays, and the reply
        ends with it."""
        at = 0 if payload.startswith(MARK) else payload.find(b"\n" + MARK) + 1
        marked = at > 0 or payload.startswith(MARK)
        if marked:
            start = at + len(MARK)
            eol = payload.find(b"\n", start)
            self._keep(payload[start:eol])
            self.went_on()
            payload = payload[:at] + payload[eol + 2:]  # what follows the mark: an ending error, if any
        err = 0 if payload.startswith(ERROR) else payload.find(b"\n" + ERROR) + 1
        if err > 0 or payload.startswith(ERROR):
            if is_cut_short(payload[err:]):
                self.stopping = True
                self.out_of_memory = OUT_OF_MEMORY in payload[err:]
                return payload[:err]
            self.finished = True  # the engine ended the reply with an error: the caller sees it
            return payload
        if payload.endswith(DONE):
            self.finished = True
            self.went_on()
        elif not marked and payload.startswith(b"data:"):
            self.broken = True  # events with no mark (an engine that does not mark them): no going on
        return payload

    def _keep(self, mark: bytes) -> None:
        try:
            index_text, total_text, ids, *end = mark.split(b" ")
            index, total = int(index_text), int(total_text)
            new = [int(i) for i in ids.split(b",")] if ids else []
        except ValueError:
            self.broken = True
            return
        if not 0 <= index < MAX_CHOICES or end not in ([], [b"end"]):
            self.broken = True
            return
        choice = self.choices.setdefault(index, Choice())
        choice.ids.extend(new)
        choice.segments.append(len(new))
        choice.ended = bool(end)
        self.kept += len(new)
        if total != len(choice.ids) or self.kept > MAX_KEPT_TOKENS:
            self.broken = True

    def resumable(self) -> bool:
        """Whether the reply can go on elsewhere."""
        return not self.finished and not self.broken and (self.reply is not None or not self.started)

    def cut(self) -> None:
        """The engine went away: count it, and time the resume from now (from the cut before, when
        the next engine went away too before the reply went on: the caller has waited since)."""
        self.cuts += 1
        if self.cut_at is None:
            self.cut_at = time.perf_counter()
        self.stopping = self.out_of_memory = False

    def went_on(self) -> None:
        """The reply goes on (the next engine's first marked write, or its end): the cut's latency."""
        if self.cut_at is not None:
            self.latencies_ms.append(round((time.perf_counter() - self.cut_at) * 1000, 1))
            self.cut_at = None

    def continuation(self, body: bytes) -> bytes:
        """The request's body to send next: with `resume` once the caller has the reply's start."""
        if not self.started:
            return body
        assert self.reply is not None
        request = msgspec.json.decode(body)
        n = request.get("n") or 1
        if isinstance(n, int) and n > 1:  # each choice goes on from its own tokens
            every = [self.choices.get(i, Choice()) for i in range(n)]
            resume: dict[str, Any] = {"choices": [{"tokens": c.ids.tolist(), "segments": c.segments.tolist(),
                                                   "ended": c.ended} for c in every]}
        else:
            resume = {"tokens": self.ids.tolist(), "segments": self.segments.tolist()}
        request["resume"] = {**resume, "id": self.reply[0], "created": self.reply[1]}
        return msgspec.json.encode(request)


def is_cut_short(error: bytes) -> bool:
    """Whether an engine's error (event or body) says a drain, a shutdown or the engine's end cut the
    reply short."""
    return any(code in error for code in CUT_CODES)
