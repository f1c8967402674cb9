"""Counters the engine reports on /admin/stats (written by the GPU thread, read by the loop)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Stats:
    started_at: float = field(default_factory=time.time)
    # Each counter has one writer: requests/prompt_tokens/rejected_* the loop, the rest the GPU thread.
    num_requests: int = 0
    num_rejected_draining: int = 0
    num_rejected_leased: int = 0
    num_completed: int = 0
    num_cancelled: int = 0
    num_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    busy_s: float = 0.0  # the GPU thread's time at work (admitting, stepping lanes): its share of uptime is the engine's load
    last_finish_reason: str | None = None
    last_completion_tokens: int = 0
    last_timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def num_active(self) -> int:
        """Jobs submitted and not yet finished (queued or running)."""
        return self.num_requests - self.num_completed - self.num_cancelled - self.num_failed
