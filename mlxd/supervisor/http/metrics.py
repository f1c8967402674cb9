"""Prometheus metrics: requests, latency, time to first token, engine states and restarts.

prometheus-client is imported on first use, not at start: it is ~0.15 s of the supervisor's
start-up on the 2-core test machine, and `/health` must answer fast. The server pre-imports
it on a background thread right after it starts listening.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from mlxd.http_errors import Handler
from mlxd.protocol.engine_state import EngineState
from mlxd.protocol.stats import LaneStats, PromptCacheStats, RamTierStats, SsdTierStats
from mlxd.supervisor.engines.pool import Pool
from mlxd.supervisor.http import access
from mlxd.supervisor.http.timeline import Timeline
from mlxd.supervisor.relay.keys import MARKS_KEY, RESUMES_KEY
from mlxd.supervisor.relay.resume import ReplyMarks

LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
MODEL_KEY = access.MODEL_KEY
UNMETERED = frozenset({"/health"})  # liveness probes would drown the request counts


class Metrics:
    """The supervisor's metrics, in their own registry (not the process-global default)."""

    def __init__(self, pool: Pool) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mlxd_requests", "HTTP requests by route, model and status.", ["route", "model", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "mlxd_request_duration_seconds", "Time from request to the end of the response.", ["route", "model"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.ttft = Histogram(
            "mlxd_time_to_first_token_seconds", "Time from request to the first streamed chunk.", ["model"],
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.resumes = Counter(
            "mlxd_resumes", "Requests whose engine died under them, by whether they went on on the next (docs/resume.md).",
            ["model", "outcome"], registry=self.registry,
        )
        self.resume_latency = Histogram(
            "mlxd_resume_seconds", "Added latency of a reply going on after its engine died: from the cut to the "
            "next engine's first words.", ["model"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.registry.register(PoolCollector(pool))

    def count_resumes(self, model: str, marks: ReplyMarks) -> None:
        """A request's cuts, once it ended."""
        if marks.cuts:  # as the pool counts them (/admin/engines' `resumes`)
            self.resumes.labels(model, "went_on").inc(marks.cuts)
        for ms in marks.latencies_ms:
            self.resume_latency.labels(model).observe(ms / 1000)
        if marks.gave_up:
            self.resumes.labels(model, "gave_up").inc()

    def render(self) -> bytes:
        """The text exposition format."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class LazyMetrics:
    """Builds the Metrics on first use."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._metrics: Metrics | None = None

    def get(self) -> Metrics:
        if self._metrics is None:
            self._metrics = Metrics(self._pool)
        return self._metrics


class PoolCollector:
    """Engine states and restart counts, read from the pool at scrape time."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        states = GaugeMetricFamily("mlxd_engine_state", "1 for each engine's current state.", labels=["model", "state"])
        restarts = CounterMetricFamily("mlxd_engine_restarts", "Engine restarts after a crash.", labels=["model"])
        for engine in self._pool.engines():
            for state in EngineState:
                states.add_metric([engine.model_id, state.value], 1.0 if engine.state is state else 0.0)
            restarts.add_metric([engine.model_id], engine.num_restarts)
        yield states
        yield restarts
        yield from lane_families([(e.model_id, e.lanes) for e in self._pool.engines() if e.lanes is not None])
        yield from prompt_cache_families([(e.model_id, e.prompt_cache) for e in self._pool.engines() if e.prompt_cache])


def lane_families(lanes: list[tuple[str, LaneStats]]) -> Iterator[Any]:
    """Each serving engine's batch width and KV budget (what `batch = "auto"` chose), the KV its
    running rows have booked, the rows paused for more urgent requests and the prefills shared
    by requests that started together, as last fetched from its /admin/stats."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    width = GaugeMetricFamily("mlxd_engine_batch_width", "Rows the engine decodes at once.", labels=["model"])
    budget = GaugeMetricFamily("mlxd_engine_kv_budget_tokens", "KV tokens the engine's running rows may book.",
                               labels=["model"])
    booked = GaugeMetricFamily("mlxd_engine_kv_booked_tokens", "KV tokens its running rows have booked.",
                               labels=["model"])
    paused = GaugeMetricFamily("mlxd_engine_paused_rows", "Rows paused for a more urgent request, waiting to resume.",
                               labels=["model"])
    counters = {
        "paused_total": CounterMetricFamily("mlxd_engine_pauses", "Rows paused for a more urgent request.", labels=["model"]),
        "resumed_total": CounterMetricFamily("mlxd_engine_resumes", "Paused rows started again.", labels=["model"]),
        "shared_prefills": CounterMetricFamily(
            "mlxd_engine_shared_prefills", "Prompt prefixes prefilled once for requests that started together.",
            labels=["model"]),
        "shared_tokens": CounterMetricFamily(
            "mlxd_engine_shared_prefill_tokens", "Prompt tokens those requests did not prefill again.", labels=["model"]),
        "image_batches": CounterMetricFamily(
            "mlxd_engine_image_batches", "Prefills of rows with images started together, run as one batch.",
            labels=["model"]),
        "image_batch_rows": CounterMetricFamily(
            "mlxd_engine_image_batch_rows", "Rows with images prefilled in those batches.", labels=["model"]),
        "draft_proposed": CounterMetricFamily(
            "mlxd_engine_draft_tokens", "Drafted tokens the model checked (speculative decoding).", labels=["model"]),
        "draft_accepted": CounterMetricFamily(
            "mlxd_engine_draft_accepted_tokens", "Drafted tokens the model kept.", labels=["model"]),
    }
    for model, lane in lanes:
        width.add_metric([model], lane.width)
        if lane.kv_budget_tokens is not None:
            budget.add_metric([model], lane.kv_budget_tokens)
        if lane.kv_booked_tokens is not None:
            booked.add_metric([model], lane.kv_booked_tokens)
        paused.add_metric([model], lane.paused)
        for key, family in counters.items():
            family.add_metric([model], getattr(lane, key))
    yield from (width, budget, booked, paused, *counters.values())


def prompt_cache_families(caches: list[tuple[str, PromptCacheStats]]) -> Iterator[Any]:
    """Each serving engine's prompt cache: entries and bytes per tier, hits per tier, misses,
    tokens reused, SSD writes, restores, their time, quarantined files and write errors."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    entries = GaugeMetricFamily("mlxd_prompt_cache_entries", "Prompt-cache entries held.", labels=["model", "tier"])
    size = GaugeMetricFamily("mlxd_prompt_cache_bytes", "Prompt-cache bytes held.", labels=["model", "tier"])
    hits = CounterMetricFamily("mlxd_prompt_cache_hits", "Requests that reused a cached prefix, by tier.",
                               labels=["model", "tier"])
    misses = CounterMetricFamily("mlxd_prompt_cache_misses", "Requests with no cached prefix.", labels=["model"])
    reused = CounterMetricFamily("mlxd_prompt_cache_reused_tokens", "Prompt tokens served from the cache.",
                                 labels=["model"])
    ssd_counters = {
        "writes": ("mlxd_prompt_cache_ssd_writes", "Entries written to SSD."),
        "written_bytes": ("mlxd_prompt_cache_ssd_written_bytes", "Bytes written to SSD."),
        "restores": ("mlxd_prompt_cache_ssd_restores", "Entries restored from SSD."),
        "quarantined": ("mlxd_prompt_cache_ssd_quarantined", "Damaged cache files moved to quarantine."),
        "write_errors": ("mlxd_prompt_cache_ssd_write_errors", "SSD writes that failed (disk full, I/O error)."),
    }
    ssd = {key: CounterMetricFamily(name, text, labels=["model"]) for key, (name, text) in ssd_counters.items()}
    seconds = CounterMetricFamily("mlxd_prompt_cache_ssd_seconds", "Time spent writing to and restoring from SSD.",
                                  labels=["model", "op"])
    checkpoints = CounterMetricFamily("mlxd_generation_checkpoints", "Running replies' KV copied to the SSD tier, "
                                      "by outcome (taken, or skipped: the writer too far behind).",
                                      labels=["model", "outcome"])
    for model, cache in caches:
        checkpoints.add_metric([model, "taken"], cache.checkpoints)
        checkpoints.add_metric([model, "skipped"], cache.checkpoints_skipped)
        tiers: dict[str, RamTierStats | SsdTierStats | None] = {"ram": cache.ram, "ssd": cache.ssd}
        for tier, figures in tiers.items():
            if figures is not None:
                entries.add_metric([model, tier], figures.entries)
                size.add_metric([model, tier], figures.bytes)
        hits.add_metric([model, "ram"], cache.hits.ram)
        hits.add_metric([model, "ssd"], cache.hits.ssd)
        misses.add_metric([model], cache.misses)
        reused.add_metric([model], cache.tokens_reused)
        if cache.ssd is not None:
            for key, family in ssd.items():
                family.add_metric([model], getattr(cache.ssd, key))
            seconds.add_metric([model, "write"], cache.ssd.write_ms / 1000)
            seconds.add_metric([model, "restore"], cache.ssd.restore_ms / 1000)
    yield from (entries, size, hits, misses, reused, *ssd.values(), seconds, checkpoints)


def make_metrics_middleware(lazy: LazyMetrics, timeline: Timeline) -> Middleware:
    """Count, time and log every request but health probes (outermost, so it sees error
    responses); an answer's tokens go to the timeline."""

    @web.middleware
    async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in UNMETERED:
            return await handler(request)
        started = time.perf_counter()
        status = "499"  # the client went away before an answer
        try:
            resp = await handler(request)
            status = "499" if left_mid_stream(request) else str(resp.status)
            return resp
        except asyncio.CancelledError:  # the caller's connection closed under the handler
            if (marks := request.get(MARKS_KEY)) is not None and marks.finished:
                status = "200"  # after the whole stream went out: it had all of it
            raise
        finally:
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "unmatched"
            model = request.get(MODEL_KEY, "")
            metrics = lazy.get()
            metrics.requests.labels(route, model, status).inc()
            metrics.latency.labels(route, model).observe(time.perf_counter() - started)
            if (marks := request.get(RESUMES_KEY)) is not None:
                metrics.count_resumes(model, marks)
            access.log_request(request, int(status), started, timeline)

    return metrics_middleware


def left_mid_stream(request: web.Request) -> bool:
    """A stream (one that can go on, so its end is seen) whose caller went away before its end:
    its handler returned rather than being cancelled, but the caller did not get it all."""
    marks = request.get(MARKS_KEY)
    if marks is None or not marks.started or marks.finished:
        return False
    return request.transport is None or request.transport.is_closing()
