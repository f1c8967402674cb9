"""The engines that live right now, one per model, and the queue of requests waiting for them.

`Pool` carries out what `policy.plan` decides: every event (a request arrives or ends, an
engine changes state, a lease starts or ends, a timer fires) schedules one replan on the loop,
which snapshots the pool, asks the policy, and applies its actions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from mlxd.protocol.engine_state import ACCEPTING, LIVE, SERVING, EngineState
from mlxd.protocol.errors import APIError
from mlxd.protocol.memory import default_prompt_cache_bytes
from mlxd.protocol.process import DEFAULT_CHECKPOINT_TOKENS, DrainResult
from mlxd.protocol.sizing import Device
from mlxd.protocol.speculation import DEFAULT_NUM_DRAFT_TOKENS, parse_draft
from mlxd.supervisor.config import DEFAULT_GATHER_MS, PoolConfig
from mlxd.supervisor.engines import policy
from mlxd.supervisor.engines.adapter_mounts import AdapterMounts
from mlxd.supervisor.engines.engine import Engine, EngineOptions
from mlxd.supervisor.engines.footprint import (
    default_budget_bytes,
    estimate_bytes,
    group_share,
    models_memory_bytes,
    this_device,
)
from mlxd.supervisor.engines.machine_hold import MachineHold
from mlxd.supervisor.engines.pool_admin import PoolAdmin
from mlxd.supervisor.engines.spare import Spare
from mlxd.supervisor.engines.spare_timing import SpareTiming
from mlxd.supervisor.registry import ModelEntry

log = logging.getLogger("mlxd.supervisor")


@dataclass(eq=False)
class Slot:
    """The pool's bookkeeping for one model's engine."""

    engine: Engine
    entry: ModelEntry
    memory_bytes: int
    idle_ttl_s: int
    pinned: bool
    in_flight: int = 0
    last_used: float = 0.0  # monotonic
    last_used_wall: float | None = None
    closing: str | None = None  # why it admits nothing new
    retiring: asyncio.Task[None] | None = None
    last_drain: DrainResult | None = None  # the engine's report from its last retirement
    last_stop: dict[str, Any] | None = None  # its reason and timings (drain_ms, stop_ms)
    lease_id: str | None = None  # a model lease holds it
    engine_lease_token: str | None = None  # the engine's own lease, sent along with the holder's requests
    on_lease_lost: Callable[[str], None] | None = None


@dataclass(eq=False)
class Waiter:
    id: int
    slot: Slot
    since: float
    holds_lease: bool
    timeout_s: float | None
    priority: int = 0  # lower: its model starts sooner when several wait (policy rule 3)
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


def limits_from(config: PoolConfig, device: Device = "cpu") -> policy.Limits:
    """The policy's limits from the `[pool]` table (`device`: where the engines' models live)."""
    budget = (
        int(config.memory_budget_gb * 1024**3) if config.memory_budget_gb
        else default_budget_bytes(config.memory_fraction, device)
    )
    return policy.Limits(budget, config.max_loaded, config.max_queue, config.queue_timeout_s)


def crash_limits_from(config: PoolConfig) -> policy.CrashLimits:
    """The crash-loop rules' limits from the `[pool]` table."""
    return policy.CrashLimits(config.crash_limit, config.crash_window_s, config.cooldown_s, config.cooldown_max_s,
                              config.healthy_reset_s)


def engine_args_from(config: PoolConfig, kv_dir: Path | None = None) -> tuple[str, ...]:
    """Engine flags from the `[pool]` table (only those that differ from the engine's defaults),
    and the SSD tier's root in the data dir."""
    args: list[str] = []
    if config.warmup != "auto":
        args += ["--warmup", config.warmup]
    if config.adapter_merge != "auto":
        args += ["--adapter-merge", config.adapter_merge]
    if config.draft != "none" and parse_draft(config.draft)[0] != "model":  # a draft model: per model (registry.py)
        args += ["--draft", config.draft]
    if config.num_draft_tokens != DEFAULT_NUM_DRAFT_TOKENS:
        args += ["--num-draft-tokens", str(config.num_draft_tokens)]
    if config.gather_ms != DEFAULT_GATHER_MS:
        args += ["--gather-ms", f"{config.gather_ms:g}"]
    if config.prompt_cache_bytes is not None:
        args += ["--prompt-cache-bytes", str(config.prompt_cache_bytes)]
    if config.ssd_cache_bytes is not None:
        args += ["--ssd-cache-bytes", str(config.ssd_cache_bytes)]
    if config.kv_bits is not None:
        args += ["--kv-bits", str(config.kv_bits), "--kv-group-size", str(config.kv_group_size)]
    if not config.ssd_write_behind:
        args += ["--ssd-write-behind", "off"]
    if config.generation_checkpoint != DEFAULT_CHECKPOINT_TOKENS:
        args += ["--generation-checkpoint", str(config.generation_checkpoint)]
    if kv_dir is not None:
        args += ["--ssd-cache-dir", str(kv_dir)]
    return tuple(args)


def engine_env_from(config: PoolConfig) -> tuple[tuple[str, str], ...]:
    """Environment every engine gets from the `[pool]` table: MLX settings MLX reads once, at its
    first use in a process, so they cannot be flags (a spare has imported MLX before it is given
    its model). `cuda_graphs = false` adds nothing: the engine's own default (mlx_env.py) holds,
    unless the supervisor's environment says otherwise."""
    return (("MLX_USE_CUDA_GRAPHS", "1"),) if config.cuda_graphs else ()


def prompt_cache_bytes(config: PoolConfig, device: Device = "cpu", budget_bytes: int | None = None) -> int:
    """What an engine's prompt cache may hold in RAM (counted in its memory estimate). On CUDA its
    entries live on the GPU, so there, as the engine sizes it (engine/gpu/device_memory.py's
    prompt_cache_sized), the default is also at most that of the memory the engine is given."""
    if config.prompt_cache_bytes is not None:
        return config.prompt_cache_bytes
    ram = default_prompt_cache_bytes(psutil.virtual_memory().total)
    if device == "cuda" and budget_bytes is not None:
        return min(ram, default_prompt_cache_bytes(budget_bytes))
    return ram


class Pool:
    """Engines by model, the wait queue, and its replans (policy.py decides, this applies).

    The admin verbs live in pool_admin.py, a whole-machine lease in machine_hold.py and the
    spare's timer in spare_timing.py; what is left (about 29 methods, most of them small
    views for the admin routes and metrics) is the queue and the plan, which share its state.
    """

    def __init__(
        self, runtime_dir: Path, options: EngineOptions | None = None, config: PoolConfig | None = None,
        clock: Callable[[], float] = time.monotonic, kv_dir: Path | None = None,
    ) -> None:
        self._runtime_dir = runtime_dir
        self.config = config or PoolConfig()
        self._options = dataclasses.replace(options or EngineOptions(), crash=crash_limits_from(self.config),
                                            engine_args=engine_args_from(self.config, kv_dir),
                                            engine_env=engine_env_from(self.config))
        self._device = this_device()  # the widest `auto` width the estimates plan for, and the budget's memory
        self.limits = limits_from(self.config, self._device)
        self.models_memory_bytes = models_memory_bytes(self._device)  # what the budget is a share of
        self.clock = clock
        self._slots: dict[str, Slot] = {}
        self._queue: list[Waiter] = []
        self._ids = itertools.count(1)
        self._replan_scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.spare = Spare(self._options.module, self.config.spare_engine and spare_allowed(self._options),
                           on_exit=self._on_spare_exit, env=dict(self._options.engine_env))
        self.spare_timing = SpareTiming(self.spare, self._is_quiet)
        self.admin = PoolAdmin(self)  # loads, unloads, drains, a lease's hold
        self.machine = MachineHold(self.schedule_replan, self.spare.stop)  # `mlxd lease --all`
        self.num_evictions = 0  # engines stopped to make room for another model
        self.resumes: dict[str, list[int]] = {}  # by model: requests gone on after their engine died, and given up
        self.adapters = AdapterMounts()  # what each engine has mounted, and what is kept loaded

    # --- requests -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def use(self, entry: ModelEntry, lease_id: str | None = None) -> AsyncIterator[Slot]:
        """Wait for the model's engine (queued as the policy says); its slot, counted in flight."""
        slot = await self.acquire(entry, lease_id)
        try:
            yield slot
        finally:
            self.release(slot)

    async def acquire(self, entry: ModelEntry, lease_id: str | None = None, timeout_s: float | None = None,
                      priority: int = 0) -> Slot:
        """Queue for the model's engine until the policy admits; counted in flight from then.
        A lower `priority` starts a cold model before others' (the request's own, else its key's)."""
        slot = self.slot_for(entry)
        self._check_admissible(slot)
        holds_lease = lease_id is not None and lease_id == slot.lease_id
        waiter = Waiter(next(self._ids), slot, self.clock(), holds_lease, timeout_s, priority)
        self._queue.append(waiter)
        self.schedule_replan()
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter in self._queue:
                self._queue.remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release(slot)  # admitted just as the client left
            self.schedule_replan()
            raise
        return slot

    def release(self, slot: Slot) -> None:
        """A request admitted by `acquire` has ended."""
        slot.in_flight -= 1
        slot.last_used, slot.last_used_wall = self.clock(), time.time()
        self.schedule_replan()

    def _check_admissible(self, slot: Slot) -> None:
        if slot.engine.state is EngineState.FAILED:
            raise slot.engine.failed_error()
        if policy.never_fits(slot.memory_bytes, self.limits):
            raise too_big(slot, self.limits)
        if not policy.can_queue(len(self._queue), self.limits) and self._replan_scheduled:
            # A burst arrives faster than the coalesced replan runs: admit whom it can first,
            # so that requests a ready engine takes at once do not count as waiting.
            self._replan()
        if not policy.can_queue(len(self._queue), self.limits):
            raise APIError(503, f"Too many requests are waiting for a model ({self.limits.max_queue}); try again.",
                           type="server_error", code="queue_full", headers={"Retry-After": "1"})

    # --- the pool's contents ----------------------------------------------------------------

    def slot_for(self, entry: ModelEntry) -> Slot:
        """The model's slot, made (engine not started) on first use."""
        slot = self._slots.get(entry.id)
        if slot is None:
            # `auto` sizes itself within the pool's whole budget: the pool books what the same rule
            # gives (protocol/sizing.py), so it waits for, or evicts, what the engine will take.
            width = None if entry.batch == "auto" else entry.batch
            engine = Engine(entry.id, entry.path, self._runtime_dir, entry.max_context, self._options,
                            batch=width, memory_bytes=self.limits.budget_bytes,
                            draft=(entry.draft, entry.num_draft_tokens), defaults=entry.defaults,
                            group=entry.distributed)
            engine.spare = self.spare
            slot = Slot(engine, entry, self.memory_estimate(entry), self._configured_ttl(entry), entry.pin)
            if engine.ranks is not None and engine.ranks.spec.hosts:
                engine.ranks.host_bytes = slot.memory_bytes  # one rank's part: each other host needs it free
            engine.on_change = lambda: self._on_engine_change(slot)
            self._slots[entry.id] = slot
        return slot

    def memory_estimate(self, entry: ModelEntry) -> int:
        """What the pool books for the model's engine: its weights, the KV its sizing books
        (footprint.py), the prompt cache's RAM tier and a draft model's weights."""
        width = None if entry.batch == "auto" else entry.batch
        cache = self.prompt_cache_bytes
        group = entry.distributed
        if group is not None and (group.hosts or (group.backend == "nccl" and self._device == "cuda")):
            # This machine holds rank 0's part; each other host its own (checked against what its
            # agent says it has free as the group starts: ranks.py). NCCL ranks on this machine
            # each have a GPU of their own (protocol/group.py's rank_env), and the budget on CUDA
            # is one GPU's: rank 0 shares GPU 0 with the other engines, the others their cards.
            weights, share = group_share(entry.path, entry.size_bytes, group.ranks, group.mode)
            kv = estimate_bytes(entry.path, weights, entry.max_context, width, memory_bytes=self.limits.budget_bytes,
                                prompt_cache_bytes=cache, device=self._device) - weights
            return weights + int((kv + cache) * share)
        return estimate_bytes(entry.path, entry.size_bytes, entry.max_context, width,
                              memory_bytes=self.limits.budget_bytes, prompt_cache_bytes=cache,
                              device=self._device) + cache + entry.draft_bytes

    @property
    def prompt_cache_bytes(self) -> int:
        """The RAM tier of each engine's prompt cache (booked beside its weights)."""
        return prompt_cache_bytes(self.config, self._device, self.limits.budget_bytes)

    @property
    def device(self) -> str:
        """What the engines run on: metal, cuda or cpu."""
        return self._device

    def keep_alive(self, entry: ModelEntry, seconds: int | None) -> None:
        """How long the model's engine stays loaded once idle, from now on (Ollama's `keep_alive`):
        `seconds` (-1: for good, 0: unloaded once idle), None: its configured idle TTL."""
        slot = self.slot_for(entry)
        slot.idle_ttl_s = self._configured_ttl(entry) if seconds is None else seconds
        self.schedule_replan()

    def _configured_ttl(self, entry: ModelEntry) -> int:
        return entry.idle_ttl_s if entry.idle_ttl_s is not None else self.config.idle_ttl_s

    @property
    def engine_env(self) -> dict[str, str]:
        """The environment every engine gets from `[pool]` (a probe of the machine gets it too)."""
        return dict(self._options.engine_env)

    def slots(self) -> list[Slot]:
        """Every model the pool has seen, in any state."""
        return list(self._slots.values())

    def engines(self) -> list[Engine]:
        """Every engine the pool knows, in any state."""
        return [s.engine for s in self._slots.values()]

    def loaded_ids(self) -> list[str]:
        """Models whose engine is starting or ready."""
        return [m for m, s in self._slots.items() if s.engine.state in ACCEPTING]

    def count_resume(self, model_id: str, went_on: bool) -> None:
        """A request of the model's whose engine died under it went on on the next (or gave up)."""
        tally = self.resumes.setdefault(model_id, [0, 0])
        tally[0 if went_on else 1] += 1

    def num_queued(self, model_id: str) -> int:
        return sum(1 for w in self._queue if w.slot.entry.id == model_id)

    def used_bytes(self) -> int:
        return sum(s.memory_bytes for s in self._slots.values() if s.engine.state in LIVE)

    def next_expiry(self, slot: Slot) -> float | None:
        """Seconds until the idle TTL unloads this engine (None: it won't, as things stand)."""
        view = self._engine_view(slot)
        if not policy.may_expire(view):
            return None
        return max(0.0, slot.last_used + slot.idle_ttl_s - self.clock())

    def retire(self, slot: Slot) -> asyncio.Task[None]:
        """Drain (bounded) and stop the slot's engine, once: the task doing it."""
        if slot.retiring is None:
            slot.retiring = asyncio.create_task(self._retire(slot))
        return slot.retiring

    def admin_wait_s(self) -> float:
        """Admin loads and leases wait for a cold start, however short the request queue's timeout."""
        return max(self.limits.queue_timeout_s, self._options.boot_timeout_s)

    # --- the plan -------------------------------------------------------------------------

    def schedule_replan(self) -> None:
        """Replan soon (once, however many changes come before it runs)."""
        if not self._replan_scheduled:
            self._replan_scheduled = True
            asyncio.get_running_loop().call_soon(self._replan)

    def _replan(self) -> None:
        self._replan_scheduled = False
        view = self._view()
        by_id = {w.id: w for w in self._queue}
        for action in policy.plan(view):
            self._apply(action, by_id)
        if not any(s.engine.state in LIVE for s in self._slots.values()):
            self.machine.engines_gone()
        self._arm_timer(policy.next_deadline(self._view()))
        self.spare_timing.arm()

    def _on_spare_exit(self) -> None:
        """The idle spare died (and is reaped): another comes after the quiet delay, backed off."""
        self.spare_timing.disarm()  # a refill armed before the death would not wait out the back-off
        self.schedule_replan()

    def _is_quiet(self) -> bool:
        """Nothing queued, in flight or starting."""
        busy = (s.in_flight or s.engine.state is EngineState.STARTING for s in self._slots.values())
        return not self._queue and not self.machine.is_held and not any(busy)

    def _apply(self, action: policy.Action, waiters: dict[int, Waiter]) -> None:
        match action:
            case policy.Admit(waiter=wid):
                waiter = waiters[wid]
                self._queue.remove(waiter)
                if not waiter.future.done():
                    waiter.slot.in_flight += 1
                    waiter.future.set_result(None)
            case policy.Reject(waiter=wid, reason=reason):
                waiter = waiters[wid]
                self._queue.remove(waiter)
                self._fail(waiter, too_big(waiter.slot, self.limits) if reason == "too_big" else queue_timeout(waiter))
            case policy.Start(model=model):
                self._start(self._slots[model])
            case policy.Close(model=model, reason=reason):
                slot = self._slots[model]
                if slot.closing is None:
                    slot.closing = reason
                    self.num_evictions += reason.startswith("making room")
                    log.info("[%s] closing: %s", model, reason)
            case policy.Retire(model=model):
                slot = self._slots[model]
                self.retire(slot)

    def _start(self, slot: Slot) -> None:
        if slot.engine.state is EngineState.FAILED:  # its waiters queued before it failed
            self._fail_waiters(slot, slot.engine.boot_error or slot.engine.failed_error())
            return
        self.adapters.release(slot)  # a new process: adapters loaded on first use are loaded again when asked
        slot.engine.start()
        # Its idle clock starts now: an engine whose one waiter left while it loaded lives its TTL
        # (it had `last_used` 0, so the TTL had passed before it was ready and it was unloaded).
        slot.last_used = self.clock()
        task = asyncio.create_task(self._watch_boot(slot))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch_boot(self, slot: Slot) -> None:
        """A boot failure reaches the requests that waited for it, as the error it is."""
        try:
            await slot.engine.ensure_ready()
        except APIError as err:
            self._fail_waiters(slot, err)

    def _fail_waiters(self, slot: Slot, err: APIError) -> None:
        for waiter in [w for w in self._queue if w.slot is slot]:
            self._queue.remove(waiter)
            self._fail(waiter, err)

    async def _retire(self, slot: Slot) -> None:
        started = time.perf_counter()
        try:
            slot.last_drain = await slot.engine.retire(self.config.drain_timeout_s)
            took_ms = round((time.perf_counter() - started) * 1000, 1)
            slot.last_stop = {"reason": slot.closing, "ms": took_ms, **slot.engine.stop_timings}
            log.info("[%s] unloaded (%s) in %.0f ms", slot.entry.id, slot.closing, took_ms)
        finally:
            slot.closing, slot.retiring = None, None
            self.schedule_replan()

    def _on_engine_change(self, slot: Slot) -> None:
        # A FAILED engine's waiters get its error from _watch_boot (the Start the policy asks for).
        state = slot.engine.state
        if slot.lease_id is not None and state not in SERVING:
            lost, slot.lease_id = slot.lease_id, None
            if slot.on_lease_lost is not None:
                slot.on_lease_lost(lost)
        self.schedule_replan()

    def _fail(self, waiter: Waiter, err: APIError) -> None:
        if not waiter.future.done():
            waiter.future.set_exception(err)

    def _arm_timer(self, deadline: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if deadline is not None:
            delay = max(0.0, deadline - self.clock()) + 0.001
            self._timer = asyncio.get_running_loop().call_later(delay, self.schedule_replan)

    def _view(self) -> policy.PoolView:
        engines = {m: self._engine_view(s) for m, s in self._slots.items()}
        waiters = [
            policy.WaiterView(w.id, w.slot.entry.id, w.since, w.slot.memory_bytes, w.holds_lease, w.timeout_s,
                              w.priority)
            for w in self._queue
        ]
        return policy.PoolView(engines, waiters, self.limits, self.clock(), self.machine.is_held)

    def _engine_view(self, slot: Slot) -> policy.EngineView:
        return policy.EngineView(
            model=slot.entry.id, state=slot.engine.state, memory_bytes=slot.memory_bytes,
            in_flight=slot.in_flight, last_used=slot.last_used, pinned=slot.pinned,
            leased=slot.lease_id is not None, closing=slot.closing is not None, idle_ttl_s=slot.idle_ttl_s,
        )

    async def stop_all(self) -> None:
        """Stop every engine (SIGTERM, then SIGKILL after the grace period), in parallel."""
        if self._timer is not None:
            self._timer.cancel()
        self.spare_timing.disarm()
        for waiter in self._queue:
            self._fail(waiter, APIError(503, "mlxd is shutting down.", type="server_error", code="shutting_down"))
        self._queue.clear()
        self.spare.enabled = False  # the engines' last state changes must not make a new spare
        await asyncio.gather(self.spare.stop(), *(s.engine.stop() for s in self._slots.values()))

def spare_allowed(options: EngineOptions, env: Mapping[str, str] = os.environ) -> bool:
    """Spares are real engines only (not a test's fake), and `MLXD_SPARE_ENGINE=0` turns them off."""
    return options.module == "mlxd.engine" and env.get("MLXD_SPARE_ENGINE", "1") != "0"


def too_big(slot: Slot, limits: policy.Limits) -> APIError:
    gib = 1024**3
    return APIError(
        400,
        f"Model {slot.entry.id} needs about {slot.memory_bytes / gib:.1f} GiB (its weights, its prompt cache and "
        f"the least KV it can run with), more than mlxd's memory budget of {limits.budget_bytes / gib:.1f} GiB: "
        "raise [pool] memory_budget_gb or memory_fraction (on CUDA the budget is one GPU's memory; a model "
        "larger than one GPU runs as an NCCL engine group), lower [pool] prompt_cache_bytes, or use a smaller "
        "(quantized) model.",
        param="model", code="model_too_large",
    )


def queue_timeout(waiter: Waiter) -> APIError:
    return APIError(
        503, f"Timed out waiting for model {waiter.slot.entry.id} to become available; try again.",
        type="server_error", code="queue_timeout", headers={"Retry-After": "5"},
    )
