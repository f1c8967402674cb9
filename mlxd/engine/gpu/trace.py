"""`MLXD_TRACE_STEPS=PATH`: one JSON line per gateway turn, to see where a burst's time goes.

For benchmarks and debugging, off by default. Each line: `t` (ms since the engine began
serving), `ms` (the turn's length), `received` (jobs that came in since the last turn),
`admitted` (jobs started this turn), `serial` and `batch`
(rows in each lane after the turn), `prefilling` (rows with no token yet, either lane) and `waiting`
(jobs queued for room), and `gc` (the garbage collector's runs since the last line, all
generations, in any thread). When the turn had them: `next_ms` (the batch lane's generator
step: mlx-lm's, or a verification pass; the rest of `ms` is mlxd's own work around it),
`peak_mb` (MLX's peak memory during the turn: the trace resets MLX's peak as it begins and each turn, so
/admin/stats' `mlx_peak_bytes` is the last turn's while it runs), `ended` (rows that ended,
any lane), and with drafts `passes` (batch steps that checked
drafts) and `idle_reads` (that read the rows' tokens and checked none), and `lingered` (rows that
ended and stayed in the batch to leave with others: linger.py).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from collections.abc import Iterator
from typing import IO, Any, TypeVar

import mlx.core as mx

T = TypeVar("T")

_parts: dict[str, float] = {}  # step parts timed since the last line (time_steps), in ms


_on = bool(os.environ.get("MLXD_TRACE_STEPS"))


_OFF = contextlib.nullcontext()  # what `part` gives when the trace is off: nothing made per step


def part(name: str) -> contextlib.AbstractContextManager[None]:
    """Time a part of a turn into its line as `NAME_ms` (summed within the turn); with
    MLXD_TRACE_STEPS set only (read at import: the engine's environment)."""
    return _timed(name) if _on else _OFF


@contextlib.contextmanager
def _timed(name: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        _parts[f"{name}_ms"] = _parts.get(f"{name}_ms", 0.0) + (time.perf_counter() - started) * 1000


def time_steps(gen: T) -> T:
    """`gen`, a batch generator; with MLXD_TRACE_STEPS set, each of its steps timed (`next_ms`)."""
    if not os.environ.get("MLXD_TRACE_STEPS"):
        return gen
    step = gen.next  # type: ignore[attr-defined]

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            _parts["next_ms"] = _parts.get("next_ms", 0.0) + (time.perf_counter() - started) * 1000

    gen.next = timed  # type: ignore[attr-defined]
    return gen


class StepTrace:
    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives with the engine
        self._t0 = time.perf_counter()
        self._gc_runs = self._collections()
        self._counts: dict[str, int] = {}  # the running counters' values at the last line
        _parts.clear()  # what the warm-up's steps left
        mx.reset_peak_memory()  # and its peak (or the width probe's): not the first turn's

    @staticmethod
    def _collections() -> int:
        return sum(generation["collections"] for generation in gc.get_stats())

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get("MLXD_TRACE_STEPS")
        return cls(path) if path else None

    def turn(self, started: float, ended: float, /, passes: int = 0, idle_reads: int = 0, lingered: int = 0,
             **fields: int) -> None:
        """One line; `passes`, `idle_reads` and `lingered` are the engine's running counts (a line has what
        this turn added, when it added any), `ended` (in `fields`) is left out when 0."""
        runs = self._collections()
        line: dict[str, Any] = {"t": round((started - self._t0) * 1000, 2), "ms": round((ended - started) * 1000, 2),
                                **{k: v for k, v in fields.items() if k != "ended" or v}, "gc": runs - self._gc_runs}
        line.update({k: round(v, 2) for k, v in _parts.items()})
        line["peak_mb"] = round(mx.get_peak_memory() / 1e6, 1)
        mx.reset_peak_memory()
        _parts.clear()
        for name, value in (("passes", passes), ("idle_reads", idle_reads), ("lingered", lingered)):
            if delta := value - self._counts.get(name, 0):
                line[name] = delta
            self._counts[name] = value
        self._gc_runs = runs
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()
