"""The lanes and their scheduler: one turn starts what the scheduler decides, then steps each lane.

The gateway's loop calls `turn` (the warm-up does too, on a Runner of its own). Lanes are
reached through the Lane protocol; the one place that knows which is which is the merge, where
the serial lane's sequence joins the batch's rows.
"""

from __future__ import annotations

import logging

from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.gpu.batch_lane import BatchLane
from mlxd.engine.gpu.checkpoints import Checkpoints
from mlxd.engine.gpu.lane import Lane
from mlxd.engine.gpu.options import GatewayOptions
from mlxd.engine.gpu.scheduler import Drop, LaneLoad, Pause, Refuse, Scheduler, Start
from mlxd.engine.gpu.scheduling import LaneName
from mlxd.engine.gpu.sequence import Sequence
from mlxd.engine.gpu.serial_lane import SerialLane
from mlxd.engine.gpu.stats import Stats
from mlxd.engine.gpu.step_failure import failed_step
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.protocol.events import Failed

log = logging.getLogger("mlxd.engine")


class Runner:
    """The scheduler's queue and the lanes it starts jobs in (GPU thread; counts read anywhere)."""

    def __init__(
        self, loaded: LoadedModel, stats: Stats, options: GatewayOptions, kv_budget_tokens: int, cache: PrefixCache,
        short_budget_hint: str = "",
    ) -> None:
        self._stats = stats
        assert options.batch is not None, "sized at load (loader.size_options)"
        self.scheduler: Scheduler[Sequence] = Scheduler(options.batch, kv_budget_tokens, short_budget_hint)
        solo = max(options.solo_prefill_step, options.prefill_step)
        saves = Checkpoints(options.generation_checkpoint, cache, loaded) if options.generation_checkpoint else None
        self._saves = saves
        serial = SerialLane(loaded, stats, solo, cache, options.kv_bits, options.kv_group_size, options.draft, saves)
        batch = (BatchLane(loaded, stats, options.prefill_step, options.batch, cache, solo_step=solo,
                           draft=options.draft, checkpoints=saves)
                 if options.batch > 1 else None)
        self._lanes: dict[LaneName, Lane] = {"serial": serial} if batch is None else {"serial": serial, "batch": batch}
        self._merge = (serial, batch) if batch is not None else None
        self.num_paused = 0  # sequences paused and waiting to resume (GPU thread writes; one read each)
        self.num_ended = 0  # sequences the last turn's lane steps ended (for the step trace)

    @property
    def has_work(self) -> bool:
        return self.scheduler.num_waiting > 0 or any(lane.has_work for lane in self._lanes.values())

    @property
    def num_rows(self) -> int:
        """Sequences running, in all lanes."""
        return sum(lane.num_rows for lane in self._lanes.values())

    @property
    def num_prefilling(self) -> int:
        return sum(lane.num_prefilling for lane in self._lanes.values())

    def rows_in(self, name: LaneName) -> int:
        lane = self._lanes.get(name)
        return lane.num_rows if lane is not None else 0

    def enqueue(self, seq: Sequence) -> None:
        self.scheduler.enqueue(seq)

    def turn(self, is_stopping: bool = False) -> int:
        """Start what the scheduler decides, then step each lane that has work once; the jobs started."""
        started = self._start_waiting(is_stopping)
        self._merge_lanes()
        self.num_ended = 0
        for lane in self._lanes.values():
            if lane.has_work:
                for seq in lane.step():
                    self.scheduler.release(seq)
                    self.num_ended += 1
        if self.num_ended and self._saves is not None:
            self._saves.prune()
        return started

    def _start_waiting(self, is_stopping: bool) -> int:
        if not self.scheduler.num_waiting:  # the usual decode turn: nothing to look at the lanes for
            return 0
        started = 0
        pausable = tuple((seq, name) for name, lane in self._lanes.items() for seq in lane.pausable())
        urgency = [p for lane in self._lanes.values() if (p := lane.most_urgent) is not None]
        load = LaneLoad(self._lanes["serial"].has_work, self.rows_in("batch"), pausable, min(urgency, default=None))
        for decision in self.scheduler.plan(load, is_stopping):
            if isinstance(decision, Pause):
                self._pause(decision.job, self._lanes[decision.lane])
                continue
            if decision.job.generated:  # a paused one leaves the queue
                self.num_paused -= 1
            if isinstance(decision, Drop):
                self._drop(decision.job)
            elif isinstance(decision, Refuse):
                decision.job.fail(self._stats, decision.message)
            elif isinstance(decision, Start):
                started += self._start(decision.job, self._lanes[decision.lane])
        return started

    def _pause(self, seq: Sequence, lane: Lane) -> None:
        """Out of its lane, back in the queue (the scheduler put it there); if that fails, it fails."""
        try:
            lane.pause(seq)
        except Exception as exc:
            failed_step(exc, "pausing a request")  # in an engine group it raises: the engine ends
            self.scheduler.remove(seq)
            seq.fail(self._stats, f"generation failed: {type(exc).__name__}: {exc}")
            return
        self.num_paused += 1
        self._stats.num_paused += 1
        seq.paused += 1
        log.info("paused a request (priority %d) after %d tokens for a more urgent one", seq.priority,
                 len(seq.generated))

    def _start(self, seq: Sequence, lane: Lane) -> int:
        try:
            lane.admit(seq)
        except Exception as exc:
            failed_step(exc, "starting a request")  # in an engine group it raises: the engine ends
            self.scheduler.release(seq)
            seq.fail(self._stats, f"generation failed: {type(exc).__name__}: {exc}")
            return 0
        return 1

    def _drop(self, seq: Sequence) -> None:
        """A job cancelled (or the engine stopping) while it waited; a paused one counts its tokens."""
        if seq.generated:
            seq.cancel()
            seq.finish(self._stats)
        else:
            seq.drop(self._stats)

    def _merge_lanes(self) -> None:
        """While rows decode in the batch, the serial lane's sequence joins them: one forward
        pass a step for all, instead of the serial lane's and the batch's one after the other.
        One still prefilling joins requests that start now sharing its prompt's prefix: they
        share the rest of its prefill (batch_lane.py)."""
        if self._merge is None or not all(lane.has_work for lane in self._merge):
            return
        serial, batch = self._merge
        prompt = serial.prefilling_prompt
        if prompt is not None and batch.has_arrivals and batch.shares_with_arrivals(prompt):
            prefilling = serial.hand_over_prefill()
            if prefilling is not None:
                batch.adopt_prefill(*prefilling)
            return
        moved = None
        try:
            moved = serial.hand_over()
            if moved is not None:
                batch.adopt(*moved)
        except Exception as exc:
            failed_step(exc, "moving a request into the batch")  # in an engine group it raises: the engine ends
            message = f"generation failed: {type(exc).__name__}: {exc}"
            if moved is None:
                failed = serial.fail_all(message, "generation_failed")
            else:
                moved[0].fail(self._stats, message)
                failed = [moved[0]]
            for seq in failed:
                self.scheduler.release(seq)

    def fail_running(self, message: str, code: str) -> None:
        """The GPU thread is dying: end every running sequence with an error."""
        for lane in self._lanes.values():
            lane.fail_all(message, code)

    def abandon_waiting(self, event: Failed) -> None:
        """The GPU thread is ending: answer every queued job with `event`."""
        for seq in self.scheduler.take_all():
            seq.abandon(event)
        self.num_paused = 0
