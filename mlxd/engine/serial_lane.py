"""The serial lane: one request at a time on the GPU thread, with mlx-lm's generate_step."""

from __future__ import annotations

import logging
import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step

from mlxd.engine.job import Job
from mlxd.engine.loaded_model import LoadedModel
from mlxd.engine.prompt_cache import PromptCache
from mlxd.engine.sampling import make_sampling, seed_rng
from mlxd.engine.stats import Stats
from mlxd.protocol.events import Done, Token
from mlxd.protocol.stops import StopMatcher

log = logging.getLogger("mlxd.engine")
# After the first text is emitted, release the GIL briefly so the loop thread relays it at
# once: while decoding, this thread seldom blocks (mlx-lm runs a step ahead), and the loop
# would otherwise wait for Python's 5 ms forced switch. The GPU keeps working meanwhile.
FIRST_RELAY_PAUSE_S = 0.0005


class Cancelled(Exception):
    """Raised inside prefill (from the progress callback) when the client went away."""


class SerialLane:
    """Runs one job to completion, emitting Token events and one Done; raises on failure."""

    def __init__(self, loaded: LoadedModel, stats: Stats, prefill_step: int) -> None:
        self._loaded = loaded
        self._stats = stats
        self._prefill_step = prefill_step
        self._cache = PromptCache(loaded.model)

    def run(self, job: Job) -> None:
        """Generate for `job` (GPU thread only)."""
        clock = Clock(job.submitted_at)
        cache, cached = self._cache.fetch(job.prompt)
        generated: list[int] = []
        try:
            finish = self._generate(job, cache, cached, generated, clock)
        except Cancelled:
            finish = "cancelled"
        except BaseException:
            self._cache.clear()
            raise
        self._cache.store(cache, job.prompt + generated)
        self._finish(job, finish, cached, len(generated), clock)

    def _generate(self, job: Job, cache: list[Any], cached: int, out: list[int], clock: Clock) -> str:
        seed_rng(job.sampling.seed)
        sampler, processors = make_sampling(job.sampling, job.prompt[:cached])
        steps = generate_step(
            mx.array(job.prompt[cached:]),
            self._loaded.model,
            max_tokens=job.max_tokens,
            sampler=sampler,
            logits_processors=processors,
            prompt_cache=cache,
            prefill_step_size=self._prefill_step,
            prompt_progress_callback=lambda *_: self._check_cancel(job),
        )
        try:
            return self._decode(job, steps, out, clock)
        finally:
            steps.close()

    def _decode(self, job: Job, steps: Any, out: list[int], clock: Clock) -> str:
        eos = self._loaded.eos_token_ids
        detok = self._loaded.tokenizer.detokenizer
        stops = StopMatcher(job.stops)
        emit = job.ticket.emit
        finish, has_relayed = "length", False
        for token, _ in steps:
            out.append(token)
            clock.token()
            if token in eos:
                finish = "stop"
                break
            detok.add_token(token)
            if text := stops.feed(detok.last_segment):
                emit(Token(text))
                if not has_relayed:
                    has_relayed = True
                    time.sleep(FIRST_RELAY_PAUSE_S)
            if stops.is_stopped:
                return "stop"
            self._check_cancel(job)
        return "stop" if self._flush(job, detok, stops) else finish

    def _flush(self, job: Job, detok: Any, stops: StopMatcher) -> bool:
        """Emit what the detokenizer and stop matcher held back; True if a stop matched in it."""
        detok.finalize()
        text = stops.feed(detok.last_segment)
        text += stops.flush()
        if text:
            job.ticket.emit(Token(text))
        return stops.is_stopped

    def _check_cancel(self, job: Job) -> None:
        if job.ticket.is_cancelled:
            raise Cancelled

    def _finish(self, job: Job, finish: str, cached: int, num_generated: int, clock: Clock) -> None:
        s = self._stats
        s.cached_tokens += cached
        s.completion_tokens += num_generated
        s.last_finish_reason, s.last_completion_tokens = finish, num_generated
        if finish == "cancelled":
            s.num_cancelled += 1
        else:
            s.num_completed += 1
        done = Done(finish, len(job.prompt), num_generated, cached, *clock.split_ms())
        s.last_timings_ms = {"queue": done.queue_ms, "prefill": done.prefill_ms, "decode": done.decode_ms}
        s.busy_s += (done.prefill_ms + done.decode_ms) / 1000
        job.ticket.emit(done)
        log.info(
            "%d prompt tokens (%d cached) + %d generated, %s; queue %.1f ms, prefill %.1f ms, decode %.1f tok/s",
            len(job.prompt), cached, num_generated, finish, done.queue_ms, done.prefill_ms,
            (num_generated - 1) / (done.decode_ms / 1000) if num_generated > 1 and done.decode_ms else 0.0,
        )


class Clock:
    """When a job was submitted, picked up, got its first token and its last."""

    def __init__(self, submitted_at: float) -> None:
        self.submitted_at = submitted_at
        self.started_at = time.perf_counter()
        self.first_at: float | None = None
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
