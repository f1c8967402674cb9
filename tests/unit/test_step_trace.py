"""MLXD_TRACE_STEPS's lines (gpu/trace.py): the draft counters as each turn's share."""

from __future__ import annotations

import json
import time
from pathlib import Path

from mlxd.engine.gpu.trace import StepTrace


def test_a_line_has_the_draft_counts_its_turn_added_and_the_batch_steps_times(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    trace = StepTrace(str(path))
    now = time.perf_counter()
    trace.turn(now, now + 0.002, batch=4, passes=0, idle_reads=0)
    trace.turn(now, now + 0.003, batch=4, passes=2, idle_reads=1, next_ms=2.5, leave_ms=0.4, ended=1)
    trace.turn(now, now + 0.001, batch=3, passes=2, idle_reads=1)
    trace.turn(now, now + 0.001, batch=3, passes=3, idle_reads=1)
    trace.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line.get("passes"), line.get("idle_reads")) for line in lines] == [(None, None), (2, 1), (None, None),
                                                                                  (1, None)]
    assert lines[1]["next_ms"] == 2.5 and lines[1]["leave_ms"] == 0.4 and lines[1]["ended"] == 1
    assert lines[1]["ms"] == 3.0 and lines[0]["batch"] == 4
