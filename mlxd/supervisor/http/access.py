"""The request log: one line per request on logger `mlxd.access`, and its figures for the timeline.

A generation's line carries its model, tokens in (and how many came from the prompt cache) and
out, time to first token, decode speed and status; the engine reports its part in the answer
(process.USAGE_HEADER / USAGE_COMMENT). The record's `access` attribute holds the same as a
dict, for `--log-format json`. Polls that change nothing (a GET that succeeds without a model,
such as the web page's) are logged at DEBUG, so a dashboard left open does not flood the log.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from aiohttp import web

from mlxd.protocol.process import RequestUsage
from mlxd.supervisor.http.timeline import Timeline
from mlxd.supervisor.relay.keys import FIRST_CHUNK_KEY, MODEL_KEY, RESUMES_KEY, USAGE_KEY

log = logging.getLogger("mlxd.access")


def log_request(request: web.Request, status: int, started: float, timeline: Timeline) -> None:
    """Log the request that just ended, and put its tokens on the timeline."""
    usage = request.get(USAGE_KEY)
    model = request.get(MODEL_KEY) or None
    first = request.get(FIRST_CHUNK_KEY)
    now = time.perf_counter()
    ttft_ms = (first - started) * 1000 if first is not None else usage.queue_ms + usage.prefill_ms if usage else None
    record = access_record(request, status, (now - started) * 1000, model, usage, ttft_ms)
    level = logging.INFO if model or request.method not in ("GET", "HEAD") or status >= 400 else logging.DEBUG
    if log.isEnabledFor(level):
        log.log(level, access_line(record), extra={"access": record})
    if model is not None and usage is not None:
        wall = time.time()
        ttft_at = wall - (now - first) if first is not None else None
        timeline.record(model, wall, usage.completion_tokens - usage.resumed, usage.decode_ms / 1000, ttft_at, ttft_ms,
                        usage.cached_tokens, usage.paused)


def access_record(request: web.Request, status: int, duration_ms: float, model: str | None,
                  usage: RequestUsage | None, ttft_ms: float | None) -> dict[str, Any]:
    """The request's figures (None where they do not apply)."""
    return {
        "method": request.method, "path": request.path, "status": status, "model": model,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "cached_tokens": usage.cached_tokens if usage else None,
        "completion_tokens": usage.completion_tokens if usage else None,
        "ttft_ms": round(ttft_ms, 1) if ttft_ms is not None else None,
        "tokens_per_s": decode_speed(usage),
        "duration_ms": round(duration_ms, 1),
        "finish_reason": usage.finish_reason if usage else None,
        "paused": usage.paused if usage else None,
        "drafts": [usage.draft_accepted, usage.draft_proposed] if usage and usage.draft_proposed else None,
        "client": request.remote,
        "resumes": resumes(request),
    }


def resumes(request: web.Request) -> dict[str, Any] | None:
    """How the request went on after its engine died (None: it did not die under it)."""
    marks = request.get(RESUMES_KEY)
    if marks is None:
        return None
    return {"count": marks.cuts, "added_ms": marks.latencies_ms, "gave_up": marks.gave_up}


def decode_speed(usage: RequestUsage | None) -> float | None:
    """Tokens a second after the first (the first one's time is prefill's): None for fewer than 2.
    A reply that went on after a crash: the last engine's tokens over its decode time."""
    made = usage.completion_tokens - usage.resumed if usage is not None else 0
    if usage is None or made < 2 or usage.decode_ms <= 0:
        return None
    return round((made - 1) / (usage.decode_ms / 1000), 1)


def access_line(r: dict[str, Any]) -> str:
    """`POST /v1/chat/completions 200 qwen in=812 cached=800 out=64 ttft=95ms 41.3tok/s 1.62s`."""
    parts = [r["method"], r["path"], str(r["status"])]
    if r["model"]:
        parts.append(r["model"])
    if r["prompt_tokens"] is not None:
        parts += [f"in={r['prompt_tokens']}", f"cached={r['cached_tokens']}", f"out={r['completion_tokens']}"]
    if r["ttft_ms"] is not None:
        parts.append(f"ttft={r['ttft_ms']:.0f}ms")
    if r["tokens_per_s"] is not None:
        parts.append(f"{r['tokens_per_s']}tok/s")
    if (resumed := r.get("resumes")) is not None:
        added = "+".join(f"{ms:.0f}ms" for ms in resumed["added_ms"])
        parts.append(f"resumed={resumed['count']}" + (f"(+{added})" if added else "")
                     + (" gave-up" if resumed["gave_up"] else ""))
    if r["finish_reason"] not in (None, "stop"):
        parts.append(f"finish={r['finish_reason']}")
    if r.get("paused"):
        parts.append(f"paused={r['paused']}")
    if r.get("drafts"):
        parts.append(f"drafts={r['drafts'][0]}/{r['drafts'][1]}")  # kept / checked
    duration = r["duration_ms"]
    parts.append(f"{duration / 1000:.2f}s" if duration >= 1000 else f"{duration:.0f}ms")
    return " ".join(parts)
