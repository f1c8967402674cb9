"""One request on the GPU thread: what both lanes do with each token it gets.

A lane produces token ids; the sequence turns them into text (detokenizer), holds back what
could be the start of a stop string, ends at EOS, a stop string or max_tokens, times the
request, and sends the events. Both lanes use it, so a stop string or a usage count cannot
differ by lane. It is made when the job is submitted, so every reply to the job goes through
it: dropped while queued, refused, cancelled, failed or done.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from mlxd.engine.gpu.job import Job
from mlxd.engine.gpu.scheduling import kv_tokens
from mlxd.engine.gpu.stats import Stats
from mlxd.protocol.events import Done, Failed, Speculation, Token, TokenLogprob
from mlxd.protocol.stops import StopMatcher

log = logging.getLogger("mlxd.engine")
# After a sequence's first text is emitted, release the GIL briefly so the loop thread relays
# it at once: while decoding, this thread seldom blocks (mlx-lm runs a step ahead), and the
# loop would otherwise wait for Python's 5 ms forced switch. The GPU keeps working meanwhile.
FIRST_RELAY_PAUSE_S = 0.0005


class Sequence:
    """A job being generated: its text state, its clock, and how it ended."""

    __slots__ = ("_detok", "_eos", "_grown", "_has_relayed", "_pending", "_reported", "_stops", "_tokenizer", "base",
                 "cached", "clock", "finish_reason", "generated", "job", "paused", "saved", "tally")

    def __init__(self, job: Job, tokenizer: Any, eos: set[int]) -> None:
        self.job = job
        self.cached = 0  # prompt tokens served from the prompt cache (set by `start`)
        self.clock = Clock(job.submitted_at)
        self.generated: list[int] = []
        self._grown: list[int] | None = None  # grown_history's list
        self.finish_reason: str | None = None  # set once it ended
        self.paused = 0  # times a lane paused it for a more urgent job
        self.saved = 0  # of its history, the tokens whose KV is on SSD or on its way (gpu/checkpoints.py)
        self.base: Any = None  # its newest checkpoint (a prefix_cache Entry): the next is a delta on it
        self.tally: Any = None  # drafts proposed and kept, once it decoded with drafts (spec/serial.py's Tally)
        self._detok = tokenizer.detokenizer
        if job.continues_text:
            keep_first_space(self._detok)
        self._eos = eos
        self._stops = StopMatcher(job.stops)
        self._has_relayed = False
        self._tokenizer = tokenizer
        self._pending: list[TokenLogprob] = []  # log probabilities of tokens whose text is held back
        self._reported = 0  # of `generated`, the ids sent with a Token so far
        if job.resumed:  # a continued reply: its text so far was delivered; only the state is wanted
            for token in job.prompt[-job.resumed:]:
                self._detok.add_token(token)
                self._stops.feed(self._detok.last_segment)

    @property
    def is_cancelled(self) -> bool:
        return self.job.ticket.is_cancelled

    @property
    def priority(self) -> int:
        return self.job.priority

    @property
    def kv_need(self) -> int:
        """The KV it books while it runs (the scheduler's Waiting protocol)."""
        return kv_tokens(len(self.job.prompt), self.job.max_tokens)

    @property
    def group_size(self) -> int:
        """Choices of its request (n) that come with it, itself included."""
        return self.job.group.size if self.job.group is not None else 1

    def start(self, cached: int) -> None:
        """A lane took it, with `cached` prompt tokens from the prompt cache: its clock starts."""
        self.cached = self.saved = cached
        self.clock.start()

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def history(self) -> list[int]:
        """Prompt and generated tokens so far."""
        return self.job.prompt + self.generated

    def grown_history(self) -> list[int]:
        """The history as one list kept from call to call and grown by the tokens generated since
        (a batch row's drafter reads it every step: no copy of a long prompt each time). The
        caller must not change it."""
        grown, prompt = self._grown, self.job.prompt
        if grown is None or len(grown) > len(prompt) + len(self.generated):
            grown = self._grown = self.history
        elif len(grown) < len(prompt) + len(self.generated):
            grown.extend(self.generated[len(grown) - len(prompt):])
        return grown

    def add(self, token: int, logprobs: Any = None) -> bool:
        """Take the next generated token (and the step's log probabilities over the vocabulary,
        for a request that asked for them); True when the sequence has ended (EOS, stop, length)."""
        self.generated.append(token)
        self.clock.token()
        if token in self._eos:
            return self._end("stop")
        if self.job.logprobs is not None and logprobs is not None:
            self._pending.append(token_logprob(self._tokenizer, token, logprobs, self.job.logprobs))
        self._detok.add_token(token)
        if text := self._stops.feed(self._detok.last_segment):
            self._emit(text)
        if self._stops.is_stopped:
            self.finish_reason = "stop"  # what followed the stop string is dropped
            return True
        if len(self.generated) >= self.job.max_tokens:
            return self._end("length")
        return False

    def _end(self, reason: str) -> bool:
        """Emit what the detokenizer and stop matcher held back; a stop string in it wins."""
        self._detok.finalize()
        text = self._stops.feed(self._detok.last_segment) + self._stops.flush()
        if text:
            self._emit(text)
        self.finish_reason = "stop" if self._stops.is_stopped else reason
        return True

    @property
    def position(self) -> int:
        """The place of its next token in the reply (a seeded sampler's key, gpu/sampling.py)."""
        return self.job.resumed + len(self.generated)

    @property
    def num_prompt(self) -> int:
        """The prompt's tokens as the caller counts them (a continued reply's output is not prompt)."""
        return len(self.job.prompt) - self.job.resumed

    def _emit(self, text: str) -> None:
        pending, self._pending = self._pending, []
        ids, self._reported = self.generated[self._reported:], len(self.generated)
        if self._has_relayed:
            self.job.ticket.emit(Token(text, pending or None, ids=ids))
        else:
            self.job.ticket.emit(Token(text, pending or None, self.num_prompt, min(self.cached, self.num_prompt), ids))
            self._has_relayed = True
            time.sleep(FIRST_RELAY_PAUSE_S)

    def cancel(self) -> None:
        """The client went away (or a drain or shutdown ended it)."""
        self.finish_reason = "cancelled"

    def finish(self, stats: Stats) -> Done:
        """Count the ended sequence and send its Done (its finish_reason must be set)."""
        finish = self.finish_reason or "length"
        num = len(self.generated)
        stats.cached_tokens += self.cached
        stats.completion_tokens += num
        stats.last_finish_reason, stats.last_completion_tokens = finish, num
        if finish == "cancelled":
            stats.num_cancelled += 1
        else:
            stats.num_completed += 1
        tally = self.tally
        done = Done(finish, self.num_prompt, self.job.resumed + num, min(self.cached, self.num_prompt), *self.clock.split_ms(),
                    stop_sequence=self._stops.matched if finish == "stop" else None, paused=self.paused,
                    speculation=Speculation(tally.proposed, tally.accepted) if tally is not None else None,
                    resumed=self.job.resumed, tail=tuple(self.generated[self._reported:]))
        if tally is not None:
            stats.draft_proposed += tally.proposed
            stats.draft_accepted += tally.accepted
        stats.last_timings_ms = {"queue": done.queue_ms, "prefill": done.prefill_ms, "decode": done.decode_ms}
        if num:
            stats.prefilled(done.prompt_tokens - done.cached_tokens, done.prefill_ms)
        self.job.ticket.emit(done)
        media = self.job.media
        log.info(
            "%d prompt tokens (%d cached) + %d generated, %s; %squeue %.1f ms, prefill %.1f ms, decode %.1f tok/s",
            len(self.job.prompt), self.cached, num, finish,
            f"{len(media.spans)} images or clips read in {media.request_ms:.1f} ms, " if media is not None else "",
            done.queue_ms, done.prefill_ms, (num - 1) / (done.decode_ms / 1000) if num > 1 and done.decode_ms else 0.0,
        )
        return done

    def fail(self, stats: Stats, message: str, status: int = 500, code: str = "generation_failed") -> None:
        """End the request with an error (the engine keeps serving)."""
        self.finish_reason = "failed"
        stats.num_failed += 1
        self.job.ticket.emit(Failed(message, status, code))

    def drop(self, stats: Stats) -> None:
        """End a job cancelled before any lane took it (its client left, or the engine stops)."""
        self.finish_reason = "cancelled"
        stats.num_cancelled += 1
        self.job.ticket.emit(Done("cancelled", self.num_prompt, self.job.resumed, resumed=self.job.resumed))

    def abandon(self, event: Failed) -> None:
        """The GPU thread ends with this job still queued: tell its handler (not counted)."""
        self.finish_reason = "failed"
        self.job.ticket.emit(event)


class _Heard:
    """A ticket that keeps the texts a replayed Sequence emits."""

    is_cancelled = False

    def __init__(self) -> None:
        self.texts: list[str] = []

    def emit(self, event: Any) -> None:
        if isinstance(event, Token):
            self.texts.append(event.text)


def replay(job: Job, tokenizer: Any, eos: set[int], ids: list[int], segments: list[int]) -> tuple[list[str], str | None]:
    """Run a reply's delivered tokens through a Sequence as generation would (`job`: the reply's
    job, uncontinued): the text each segment of `ids` released, and how the reply ended if these
    tokens ended it (EOS, a stop string, max_tokens), else None."""
    heard = _Heard()
    seq = Sequence(Job(job.prompt, job.max_tokens, job.sampling, job.stops, heard,  # type: ignore[arg-type]
                       continues_text=job.continues_text), tokenizer, eos)
    seq._has_relayed = True
    texts: list[str] = []
    start = 0
    for count in segments:
        for token in ids[start:start + count]:
            if not seq.is_finished:
                seq.add(token)
        start += count
        texts.append("".join(heard.texts))
        heard.texts.clear()
    return texts, seq.finish_reason


LOWEST_LOGPROB = -9999.0  # what a masked (-inf) or NaN log probability is reported as (JSON has no inf)


def token_logprob(tokenizer: Any, token: int, logprobs: Any, top: int) -> TokenLogprob:
    """`token`'s log probability in `logprobs` (mx, over the vocabulary) and the `top` likeliest."""
    import mlx.core as mx

    flat = logprobs.reshape(-1)
    chosen = _finite(float(flat[token].item()))
    alternatives: list[tuple[str, float]] = []
    if top > 0:
        ids = mx.argpartition(-flat, kth=top - 1)[:top]
        values = flat[ids]
        order = mx.argsort(-values)
        pairs: list[tuple[int, float]] = list(zip(ids[order].tolist(), values[order].tolist(), strict=True))  # type: ignore[arg-type]
        for i, v in pairs:
            alternatives.append((str(tokenizer.decode([int(i)])), _finite(float(v))))
    return TokenLogprob(str(tokenizer.decode([token])), chosen, alternatives)


def _finite(value: float) -> float:
    return value if value == value and value > LOWEST_LOGPROB else LOWEST_LOGPROB


class Clock:
    """When a job was submitted, picked up by a lane, got its first token and its last."""

    __slots__ = ("first_at", "last_at", "started_at", "submitted_at")

    def __init__(self, submitted_at: float) -> None:
        self.submitted_at = submitted_at
        self.start()
        self.first_at: float | None = None

    def start(self) -> None:
        """Note that a lane picked the job up."""
        self.started_at = time.perf_counter()
        self.last_at = self.started_at

    def token(self) -> None:
        """Note a token's arrival."""
        self.last_at = time.perf_counter()
        if self.first_at is None:
            self.first_at = self.last_at

    def split_ms(self) -> tuple[float, float, float]:
        """(queue, prefill, decode) in milliseconds."""
        first = self.first_at or self.last_at
        ms = lambda a, b: round((b - a) * 1000, 3)  # noqa: E731
        return ms(self.submitted_at, self.started_at), ms(self.started_at, first), ms(first, self.last_at)


def keep_first_space(detok: Any) -> None:
    """Have mlx-lm's streaming detokenizer keep a reply's leading space. It drops it (a chat
    reply starts with its first word), but a text completion continues the prompt's text:
    "The capital of France is" goes on with " Paris", as OpenAI's completions answer."""
    if hasattr(detok, "trim_space"):  # SPM's detokenizer takes it as an option
        detok.trim_space = False
    elif hasattr(detok, "_maybe_trim_space"):  # BPE's always trims: its one trimming step made a no-op
        detok._maybe_trim_space = lambda text: text

