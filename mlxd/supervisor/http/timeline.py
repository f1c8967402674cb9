"""The last minutes of each model's work, for the web page's charts: `GET /admin/timeline`.

Time is cut into buckets of `step_s`. A finished request's generated tokens are spread over the
buckets its decode spanned (a long answer draws a plateau, not a spike at its end); its time to
first token counts in the bucket where the first token went out.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from mlxd.protocol.supervisor_api import ModelTimeline, TimelineView

STEP_S = 2.0
NUM_BUCKETS = 300  # ten minutes
MAX_TTFT_SAMPLES = 64  # per bucket: enough for a median
RATE_SAMPLES = 32  # each model's last answers whose decode rate is kept (`decode_rate`)
RATE_MIN_TOKENS = 16  # an answer shorter than this says little about the rate


@dataclass
class _Bucket:
    number: int  # time // step: which bucket of all time this slot holds now
    completion_tokens: float = 0.0
    requests: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    paused: int = 0


class Timeline:
    """Per-model ring buffers of buckets (only the supervisor's event loop touches it)."""

    def __init__(self, step_s: float = STEP_S, num_buckets: int = NUM_BUCKETS) -> None:
        self.step_s = step_s
        self.num_buckets = num_buckets
        self._models: dict[str, list[_Bucket]] = {}
        self._rates: dict[str, deque[float]] = {}

    def decode_rate(self, model: str) -> float | None:
        """The model's measured decode speed: the fastest of its last RATE_SAMPLES answers of at
        least RATE_MIN_TOKENS tokens (a lone stream's rate: streams that share the GPU each
        decode slower); None before it has served one."""
        rates = self._rates.get(model)
        return round(max(rates), 1) if rates else None

    def record(self, model: str, end: float, completion_tokens: int, decode_s: float, ttft_at: float | None,
               ttft_ms: float | None, cached_tokens: int = 0, paused: int = 0) -> None:
        """A request that ended at wall time `end`, after `decode_s` seconds generating its tokens."""
        ring = self._models.setdefault(model, [_Bucket(-1) for _ in range(self.num_buckets)])
        ended = self._bucket(ring, end)
        ended.requests += 1
        ended.cached_tokens += cached_tokens
        ended.paused += paused > 0
        if ttft_at is not None and ttft_ms is not None and len(b := self._bucket(ring, ttft_at).ttft_ms) < MAX_TTFT_SAMPLES:
            b.append(ttft_ms)
        start = end - max(decode_s, 0.0)
        if completion_tokens >= RATE_MIN_TOKENS and decode_s > 0:
            self._rates.setdefault(model, deque(maxlen=RATE_SAMPLES)).append(completion_tokens / decode_s)
        if completion_tokens <= 0:
            return
        if end - start < 1e-9:
            self._bucket(ring, end).completion_tokens += completion_tokens
            return
        rate = completion_tokens / (end - start)
        first, last = self._number(start), self._number(end)
        for number in range(max(first, last - self.num_buckets + 1), last + 1):
            lo, hi = max(start, number * self.step_s), min(end, (number + 1) * self.step_s)
            self._bucket(ring, number * self.step_s).completion_tokens += rate * max(hi - lo, 0.0)

    def view(self, now: float) -> TimelineView:
        """The answer of GET /admin/timeline: each model's buckets up to `now`, oldest first."""
        last = self._number(now)
        numbers = range(last - self.num_buckets + 1, last + 1)
        models = {}
        for model, ring in self._models.items():
            slots = [ring[n % self.num_buckets] for n in numbers]
            held = [b if b.number == n else _Bucket(n) for b, n in zip(slots, numbers, strict=True)]
            models[model] = ModelTimeline(
                completion_tokens=[round(b.completion_tokens, 2) for b in held],  # a share of a request's
                requests=[b.requests for b in held],
                ttft_ms=[round(statistics.median(b.ttft_ms), 1) if b.ttft_ms else None for b in held],
                cached_tokens=[b.cached_tokens for b in held],
                paused=[b.paused for b in held],
            )
        return TimelineView(step_s=self.step_s, end=(last + 1) * self.step_s, buckets=self.num_buckets, models=models)

    def _number(self, t: float) -> int:
        return math.floor(t / self.step_s)

    def _bucket(self, ring: list[_Bucket], t: float) -> _Bucket:
        number = self._number(t)
        bucket = ring[number % self.num_buckets]
        if bucket.number > number:  # older than the window: counted nowhere
            return _Bucket(number)
        if bucket.number < number:  # the slot held an older bucket: start it afresh
            bucket.number, bucket.completion_tokens, bucket.requests, bucket.ttft_ms = number, 0.0, 0, []
            bucket.cached_tokens = bucket.paused = 0
        return bucket
