"""`MLXD_TRACE_STEPS=PATH`: one JSON line per gateway turn, to see where a burst's time goes.

For benchmarks and debugging, off by default. Each line: `t` (ms since the engine began
serving), `ms` (the turn's length), `received` (jobs that came in since the last turn),
`admitted` (jobs started this turn), `serial` and `batch`
(rows in each lane after the turn), `prefilling` (rows with no token yet, either lane) and `waiting`
(jobs queued for room), and `gc` (the garbage collector's runs since the last line, all
generations, in any thread). With drafts: `passes` (batch steps that checked drafts) and
`idle_reads` (that read the rows' tokens and checked none) in this turn. Where the batch lane's
step went, when it stepped: `next_ms` (the generator's step: mlx-lm's, or a verification
pass), `leave_ms` (ended rows taken out, their KV into the prompt cache), `checkpoint_ms`
(generation checkpoints taken), and `ended` (rows that ended).
"""

from __future__ import annotations

import gc
import json
import os
import time
from typing import IO


class StepTrace:
    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives with the engine
        self._t0 = time.perf_counter()
        self._gc_runs = self._collections()
        self._counts: dict[str, int] = {}  # the running counters' values at the last line

    @staticmethod
    def _collections() -> int:
        return sum(generation["collections"] for generation in gc.get_stats())

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get("MLXD_TRACE_STEPS")
        return cls(path) if path else None

    def turn(self, started: float, ended: float, /, passes: int = 0, idle_reads: int = 0, **fields: float) -> None:
        """One line; `passes` and `idle_reads` are the engine's running counts (a line has what
        this turn added, when it added any)."""
        runs = self._collections()
        line = {"t": round((started - self._t0) * 1000, 2), "ms": round((ended - started) * 1000, 2), **fields,
                "gc": runs - self._gc_runs}
        for name, value in (("passes", passes), ("idle_reads", idle_reads)):
            if delta := value - self._counts.get(name, 0):
                line[name] = delta
            self._counts[name] = value
        self._gc_runs = runs
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()
