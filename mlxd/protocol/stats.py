"""An engine's GET /health and GET /admin/stats bodies: written by the engine, read by the
supervisor (its pool's health checks, `/metrics`, `GET /admin/engines`) and by tooling."""

from __future__ import annotations

from typing import Literal

import msgspec

# /health `status`: `loading` until the model is loaded, then `ready`; `draining` during (and
# after) a drain; `failed` (with a 503) when the model could not load.
HealthStatus = Literal["loading", "ready", "draining", "failed"]
# The admission gate: `open`, or refusing new requests while `draining` or `leased`.
GateState = Literal["open", "draining", "leased"]


# What a starting engine is doing: `spawn` (the supervisor's: the process imports, no answer
# yet), `weights` (bytes read into memory), `tokenizer`, `warmup` (jobs run to compile kernels).
LoadPhase = Literal["spawn", "weights", "tokenizer", "warmup"]
PHASE_NAMES: dict[str, str] = {"spawn": "starting the engine", "weights": "reading weights",
                               "tokenizer": "loading the tokenizer", "warmup": "warming up GPU kernels"}


def phase_words(phase: str, done: int, total: int | None) -> str:
    """`reading weights 45%`, or the phase's name alone where the total is unknown."""
    text = PHASE_NAMES.get(phase, phase)
    return f"{text} {min(100, round(100 * done / total))}%" if total else text


class LoadProgress(msgspec.Struct):
    """A starting engine's progress: `done` of `total` (None: unknown) in `unit` (None: steps)."""

    phase: LoadPhase
    done: int = 0
    total: int | None = None
    unit: Literal["bytes"] | None = None
    elapsed_s: float = 0.0  # since the phase began (the supervisor reports it since the spawn)


class EngineHealth(msgspec.Struct, omit_defaults=True):
    status: HealthStatus
    model: str
    load: LoadProgress | None = None  # while `loading`


class RequestCounts(msgspec.Struct):
    total: int
    active: int  # submitted and not yet finished (queued or running)
    completed: int
    cancelled: int
    failed: int
    continued: int = 0  # replies continued after an engine died (`resume`, docs/resume.md)


class AdmissionStats(msgspec.Struct):
    state: GateState
    in_flight: int
    rejected_draining: int
    rejected_leased: int
    lease_holder: str | None


class LaneStats(msgspec.Struct):
    width: int  # rows decoded at once: --batch, or what `auto` chose
    serial: int  # rows in the serial lane (0 or 1)
    batch: int  # rows in the batch lane (choices waiting for their shared prefill included)
    waiting: int  # jobs not yet started
    kv_budget_tokens: int | None
    kv_booked_tokens: int | None
    sizing: str | None = None  # how the width and KV budget were chosen (protocol/sizing.py); None until loaded
    paused: int = 0  # rows paused for a more urgent request, waiting to resume (counted in `waiting`)
    paused_total: int = 0  # rows paused since the engine started
    resumed_total: int = 0  # paused rows started again
    shared_prefills: int = 0  # prefixes prefilled once for requests that started together
    shared_tokens: int = 0  # prompt tokens those requests did not prefill again
    image_batches: int = 0  # prefills of rows with images started together, run as one batch
    image_batch_rows: int = 0  # the rows in them
    adapters: int = 0  # LoRA adapters mounted
    adapter_bytes: int = 0  # their weights' memory
    adapter_mixed_passes: int = 0  # forward passes whose rows ran under different adapters
    adapter_merged_bytes: int = 0  # the merged copy of the layers of the stack that has every row to itself
    draft: str = "none"  # what the model drafts with (--draft): none, ngram, self:N, model:DIR
    draft_proposed: int = 0  # drafted tokens the target checked since the engine started
    draft_accepted: int = 0  # ... and kept (their share is the acceptance)
    draft_batch_passes: int = 0  # batch steps that checked drafts (rows decoding together)
    draft_batch_idle_reads: int = 0  # batch steps that read the rows' next tokens for drafts and checked none
    rows_lingered: int = 0  # rows that ended and stayed in the batch a few steps, to leave with others


class TokenCounts(msgspec.Struct):
    prompt: int
    cached: int  # prompt tokens served from the prompt cache (or a shared prefill)
    completion: int
    resumed: int = 0  # tokens continued replies went on after (delivered by an engine that died)


class RamTierStats(msgspec.Struct):
    entries: int
    bytes: int
    cap_bytes: int


class SsdTierStats(msgspec.Struct):
    dir: str
    entries: int
    bytes: int
    cap_bytes: int
    writes: int
    written_bytes: int
    write_ms: float
    write_errors: int
    restores: int
    restored_bytes: int
    restore_ms: float
    quarantined: int
    evicted: int


class CacheHits(msgspec.Struct):
    ram: int
    ssd: int


class PromptCacheStats(msgspec.Struct):
    ram: RamTierStats
    ssd: SsdTierStats | None  # None: no SSD tier
    hits: CacheHits
    misses: int
    tokens_reused: int
    ram_evicted: int
    evicted_unwritten: int  # evicted from RAM without reaching SSD
    writes_pending: int
    checkpoints: int = 0  # generation checkpoints handed to the SSD writer (gpu/checkpoints.py)
    checkpoints_skipped: int = 0  # ... due, but not taken: the writer was too far behind
    checkpoint_ms: float = 0.0  # the GPU thread's time taking them (copying the KV), all told
    restored_early: int = 0  # checkpoints of a dead engine's running replies restored at start


class LastRequest(msgspec.Struct):
    finish_reason: str | None
    completion_tokens: int
    timings_ms: dict[str, float]


class MemoryStats(msgspec.Struct):
    rss_bytes: int
    mlx_active_bytes: int
    mlx_peak_bytes: int
    mlx_cache_bytes: int
    # on CUDA, what the driver says: device_used / device_total, and its memory pool's
    # pool_reserved(_high) / pool_used(_high) (engine/gpu/cuda_memory.py); None elsewhere
    cuda: dict[str, int] | None = None


class EngineStats(msgspec.Struct):
    """GET /admin/stats."""

    model: str
    status: Literal["loading", "ready", "failed"]
    uptime_s: float
    busy_s: float  # the GPU thread's time at work
    context_window: int | None
    requests: RequestCounts
    admission: AdmissionStats
    lanes: LaneStats
    tokens: TokenCounts
    prompt_cache: PromptCacheStats | None  # None until loaded, or with no prompt cache
    last: LastRequest
    memory: MemoryStats


class EngineView(msgspec.Struct):
    """The part of /admin/stats the supervisor reads (the rest is ignored when decoding)."""

    prompt_cache: PromptCacheStats | None = None
    lanes: LaneStats | None = None
