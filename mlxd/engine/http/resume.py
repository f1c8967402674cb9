"""A continued reply: a chat or text completion whose `resume` carries the start of its reply,
already delivered by an engine that then died (the supervisor's relay sends it; docs/resume.md).

The delivered tokens are replayed through a Sequence as generation made them (gpu/sequence.py's
`replay`): the text each delivered segment released goes into the reply objects unsent, so
their tool-call and reasoning parsers, and the stop strings' hold-back, stand where the first
engine's stood. The job then runs the prompt and those tokens as its prompt and goes on from
there: greedy output is what the uninterrupted reply would have been, and a seeded one draws
the same keys (gpu/sampling.py's `token_key`). A reply those tokens already ended (a crash
after its last token but before its end) is ended at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any

from mlxd.engine.gpu.job import Job, SamplingParams
from mlxd.engine.gpu.sequence import replay
from mlxd.engine.gpu.ticket import Ticket
from mlxd.engine.http.openai_replies import Reply
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.protocol import openai as oa
from mlxd.protocol.errors import APIError
from mlxd.protocol.events import Done

Lead = tuple[list[Any], list[int]]  # a resent start's chunks, and the token ids they carry


@dataclasses.dataclass(frozen=True, slots=True)
class Continued:
    """What a request's `resume` amounts to: the reply's tokens so far, the text each delivered
    segment of them released, and whether they already ended it."""

    ids: list[int]
    texts: list[str]
    finish: str | None  # EOS, a stop string or max_tokens came with these tokens: nothing is left to run

    @property
    def text(self) -> str:
        return "".join(self.texts)


def continued(loaded: LoadedModel, resume: oa.Resume | None, prompt: list[int], max_tokens: int,
              stops: list[str], continues_text: bool = False) -> Continued | None:
    """Replay `resume`'s tokens (None: the request continues nothing). A 400 for a token id
    outside the vocabulary or a reply longer than its budget."""
    if resume is None:
        return None
    ids = list(resume.tokens) if resume.text is None else loaded.encode_text(resume.text)
    if bad := next((t for t in ids if t >= loaded.vocab_size), None):
        raise APIError(400, f"resume.tokens has token id {bad}, outside the vocabulary.", param="resume.tokens")
    if len(ids) > max_tokens:
        raise APIError(400, f"resume carries {len(ids)} tokens, more than the reply's budget of {max_tokens}.",
                       param="resume", code="context_length_exceeded")
    segments = resume.segments if resume.segments is not None and resume.text is None else [len(ids)]
    job = Job(prompt, max_tokens, SamplingParams(), stops, None, continues_text=continues_text)  # type: ignore[arg-type]
    texts, finish = replay(job, loaded.tokenizer, loaded.eos_token_ids, ids, segments)
    return Continued(ids, texts, finish)


def reply_meta(prefix: str, resume: oa.Resume | None, model: str) -> tuple[str, int, str]:
    """The reply's id, `created` and model: a continued reply keeps the ones it had."""
    rid = resume.id if resume is not None and resume.id else prefix + uuid.uuid4().hex
    created = resume.created if resume is not None and resume.created is not None else int(time.time())
    return rid, created, model


def prime(reply: Reply, cont: Continued | None) -> list[Any]:
    """Feed the delivered text to `reply`, segment by segment as it went out, sending nothing:
    the chunks it made (a stream that resends them starts with them)."""
    return [chunk for text in (cont.texts if cont is not None else ()) for chunk in reply.text(text)]


def lead(resume: oa.Resume | None, cont: Continued | None, primed: list[Any]) -> tuple[int | None, Lead | None]:
    """A continued stream's start: how many tokens of it were delivered (None: it opens as a new
    one does), and, for one that resends them, the chunks to send after its opening and their ids."""
    if cont is None or resume is None:
        return None, None
    if resume.resend:
        return None, (primed, cont.ids)
    return len(cont.ids), None


def ended_ticket(cont: Continued, num_prompt: int) -> Ticket:
    """The ticket of a reply its delivered tokens already ended: its Done, and nothing to run."""
    ticket = Ticket(asyncio.get_running_loop())
    ticket.emit(Done(cont.finish or "length", num_prompt, len(cont.ids), resumed=len(cont.ids)))
    return ticket
