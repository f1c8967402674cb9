"""The supervisor's own answers (`/v1/models`, `/health`, `/admin/*`, the Responses store's
routes), as the handlers encode them.

The handlers build these Structs and encode them with msgspec; the OpenAPI document
(supervisor/http/openapi.py) is generated from the same Structs, so a field added here reaches
both. Field order is the answers' key order. Docstrings become the schemas' descriptions.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from mlxd.protocol.engine_state import EngineState
from mlxd.protocol.process import DrainResult
from mlxd.protocol.stats import LoadProgress, PromptCacheStats

Source = Literal["config", "models_dir", "hf_cache"]  # where the registry found a model

# ---- GET /v1/models (OpenAI's shape) and GET /health ----


class ModelInfo(msgspec.Struct):
    """A model that exists, in OpenAI's shape plus where it comes from and its state."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    loaded: bool
    state: EngineState
    source: Source
    size_bytes: int
    load: LoadProgress | None  # while its engine starts: phase, done of total
    sampling: dict[str, float]  # what a request that sets none gets: the model's generation_config, else mlxd's
    context_window: int | None = None  # tokens (capped by the model's max_context); None: unreadable config
    # What it takes and does: "completion", and "vision" (images), "tools", "reasoning" (protocol/capabilities.py).
    capabilities: list[str] = msgspec.field(default_factory=list)


class ModelInfoList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelInfo]


class Health(msgspec.Struct):
    status: Literal["ok"]
    version: str
    engines: dict[str, EngineState]


# ---- GET /admin/engines ----


class EngineLease(msgspec.Struct):
    id: str
    holder: str
    expires_at: float


class Spare(msgspec.Struct):
    """The engine process kept ready for the next model start (pid null: none)."""

    pid: int | None
    warm: bool


class EngineRow(msgspec.Struct):
    """One model the pool has seen; `boot` and `last_stop` hold timings in ms."""

    model: str
    state: EngineState
    pid: int | None
    uptime_s: float | None
    rss_bytes: int | None
    memory_estimate_bytes: int
    in_flight: int
    queued: int
    last_used: float | None
    pinned: bool
    restarts: int
    resumes: int  # requests that went on on the next engine after theirs died (docs/resume.md)
    resume_failures: int  # ... and those cut more often than [pool] resume_attempts allow
    idle_ttl_s: int
    expires_in_s: float | None
    batch: int | Literal["auto"]  # the width asked for: [pool] batch, or the model's own
    width: int | None  # the rows it decodes at once (what `auto` chose); None until it serves
    kv_budget_tokens: int | None  # the KV its running rows may book in all; None until it serves
    sizing: str | None  # how the width and KV budget were chosen; None until it serves
    closing: str | None
    failure: str | None
    boot: dict[str, float] | None
    retry_at: float | None  # a failed model starts again by itself then (unix time)
    retry_in_s: float | None
    last_stop: dict[str, Any] | None
    lease: EngineLease | None
    prompt_cache: PromptCacheStats | None  # the engine's prompt cache (RAM, SSD, hits); None unless serving
    load: LoadProgress | None  # while it starts: phase, done of total (bytes of weights), elapsed since spawn
    sampling: dict[str, float]  # as in /v1/models
    # An engine group across hosts: each other host's memory, as its `mlxd rank` said at the
    # group's last start (`memory_estimate_bytes` is one rank's part, booked on this machine)
    hosts: list[dict[str, Any]] | None = None


class EngineList(msgspec.Struct):
    object: Literal["list"]
    budget_bytes: int
    used_bytes: int
    max_loaded: int | None
    machine_leased: bool
    evictions: int
    spare: Spare
    data: list[EngineRow]


# ---- POST /admin/load, /admin/unload, /admin/drain ----


class LoadAnswer(msgspec.Struct):
    model: str
    state: EngineState
    pinned: bool
    load_ms: float


class UnloadAnswer(msgspec.Struct):
    """`drain` is null when the model was not loaded."""

    model: str
    state: EngineState
    was_loaded: bool
    drain: DrainResult | None


# DrainResult's fields after `model` (a subclass would put `model` last); model_drain fills them,
# and tests/unit/test_supervisor_api.py checks the two field lists agree.
class ModelDrain(msgspec.Struct):
    model: str
    drained: bool
    finished: int
    cancelled: int
    waited_ms: float
    cache_written_bytes: int
    resumed: bool
    cache_written_entries: int = 0
    cache_write_ms: float = 0.0
    cache_complete: bool = True


def model_drain(model: str, report: DrainResult) -> ModelDrain:
    """One engine's drain report, named by its model."""
    return ModelDrain(model, **msgspec.structs.asdict(report))


class DrainAnswer(msgspec.Struct):
    drained: list[ModelDrain]


# ---- /admin/leases ----


class Lease(msgspec.Struct, kw_only=True):
    """A lease as `/admin/leases` shows it."""

    id: str
    model: str | None
    holder: str
    ttl_s: float
    created_at: float
    expires_at: float
    state: str = "held"  # "held" | "ended"
    ended_reason: str | None = None  # "released" | "expired" | "engine_crashed"


class LeaseList(msgspec.Struct):
    """Held leases first, then the last ended ones, newest first."""

    object: Literal["list"]
    data: list[Lease]


class LeaseDeleted(msgspec.Struct):
    id: str
    deleted: bool


# ---- the Responses store's routes (DELETE /v1/responses/{id}, GET .../input_items) ----


class ResponseDeleted(msgspec.Struct):
    id: str
    object: Literal["response"]
    deleted: bool


class CompactedResponse(msgspec.Struct):
    """POST /v1/responses/compact's answer: `output` is the new context (a compaction item, then
    the last user message), to send as the next turn's input."""

    id: str
    created_at: int
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, int]
    object: str = "response.compaction"


class InputItemList(msgspec.Struct):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


# ---- GET /admin/timeline ----


class ModelTimeline(msgspec.Struct):
    """One model's buckets, oldest first: tokens generated (a request's spread over its decode),
    requests ended, and the median time to first token of those whose first token came then;
    of the requests ended, the prompt tokens they did not prefill (the prompt cache's or a
    shared prefill's) and how many of them were paused for a more urgent request."""

    completion_tokens: list[float]
    requests: list[int]
    ttft_ms: list[float | None]
    cached_tokens: list[int]
    paused: list[int]


class TimelineView(msgspec.Struct):
    """The last minutes of work, in `buckets` buckets of `step_s` seconds ending at `end` (unix time)."""

    step_s: float
    end: float
    buckets: int
    models: dict[str, ModelTimeline]


class AdapterCard(msgspec.Struct, kw_only=True):
    """One LoRA adapter in GET /v1/adapters (and the answer to loading one)."""

    id: str
    object: Literal["adapter"] = "adapter"
    base_model: str | None
    path: str
    kind: str
    rank: int
    scale: float
    num_layers: int | None
    size_bytes: int
    source: str  # adapters_dir | models_dir | registered
    loaded_on: list[str]  # the models whose engine has it loaded


class AdapterCardList(msgspec.Struct):
    data: list[AdapterCard]
    object: Literal["list"] = "list"


class AdapterUnloaded(msgspec.Struct):
    id: str
    unloaded_from: list[str]
    object: Literal["adapter"] = "adapter"
