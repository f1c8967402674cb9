"""Counters the engine reports on /admin/stats (written by the GPU thread, read by the loop)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

PREFILL_SAMPLE = 64  # a reply that prefilled fewer (its prompt cached) says little of prefill's cost


@dataclass(slots=True)
class Stats:
    started_at: float = field(default_factory=time.time)
    # Each counter has one writer: requests/prompt_tokens/rejected_* the loop, the rest the GPU thread.
    num_requests: int = 0
    num_continued: int = 0  # of them, replies continued from delivered tokens (`resume`: an engine died)
    continued_tokens: int = 0  # the delivered tokens they went on after
    num_rejected_draining: int = 0
    num_rejected_leased: int = 0
    num_completed: int = 0
    num_cancelled: int = 0
    num_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    shared_prefills: int = 0  # prefixes prefilled once for requests that started together (batch lane)
    shared_tokens: int = 0  # prompt tokens those requests did not prefill again
    image_batches: int = 0  # batched prefills of rows with images started together (batch lane)
    image_batch_rows: int = 0  # the rows in them
    num_paused: int = 0  # running rows paused for a more urgent request
    num_resumed: int = 0  # paused rows started again
    draft_proposed: int = 0  # drafted tokens the target checked (speculative decoding, spec/)
    draft_accepted: int = 0  # ... and kept
    draft_batch_passes: int = 0  # batch steps that checked drafts (spec/batch.py)
    draft_batch_idle_reads: int = 0  # ... that read the rows' next tokens (a pipeline break) and checked none
    rows_lingered: int = 0  # rows that ended and stayed in the batch to leave with others (linger.py)
    prefilled_tokens: int = 0  # prompt tokens no cache served, of replies that prefilled PREFILL_SAMPLE or more
    prefill_s: float = 0.0  # ... and those replies' time from their start to their first token
    # The GPU thread's time at work (admitting, stepping lanes): its share of uptime is the
    # engine's load. One tuple, (seconds of finished turns, perf_counter at the start of the turn
    # under way or None), swapped whole, so a reader in another thread never sees half an update.
    busy: tuple[float, float | None] = (0.0, None)
    last_finish_reason: str | None = None
    last_completion_tokens: int = 0
    last_timings_ms: dict[str, float] = field(default_factory=dict)

    def prefilled(self, tokens: int, ms: float) -> None:
        """A reply prefilled `tokens` prompt tokens in `ms` (with the other rows' steps then)."""
        if tokens >= PREFILL_SAMPLE:
            self.prefilled_tokens += tokens
            self.prefill_s += ms / 1000

    def prefill_cost(self) -> float | None:
        """Seconds a prompt token has cost so far (None: too few measured; PrefixCache._pays)."""
        return self.prefill_s / self.prefilled_tokens if self.prefilled_tokens >= 4 * PREFILL_SAMPLE else None

    def turn_started(self, at: float) -> None:
        self.busy = (self.busy[0], at)

    def turn_ended(self, at: float) -> None:
        done, started = self.busy
        self.busy = (done + (at - started if started is not None else 0.0), None)

    @property
    def busy_s(self) -> float:
        """The busy time until now, the turn under way included: a request answered in a turn is
        counted in full when its answer is read, though the turn goes on after it."""
        done, started = self.busy
        return done + (time.perf_counter() - started if started is not None else 0.0)

    @property
    def num_active(self) -> int:
        """Jobs submitted and not yet finished (queued or running)."""
        return self.num_requests - self.num_completed - self.num_cancelled - self.num_failed
