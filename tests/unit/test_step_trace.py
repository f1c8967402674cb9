"""MLXD_TRACE_STEPS's lines (gpu/trace.py): each turn's share of the draft counters, the timed
generator steps, and rows ended only when there were some."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from mlxd.engine.gpu import trace
from mlxd.engine.gpu.trace import StepTrace


class Generator:
    def next(self) -> list[Any]:
        time.sleep(0.003)
        return []


def test_a_line_has_what_its_turn_added(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("MLXD_TRACE_STEPS", str(path))
    gen = Generator()
    trace.time_steps(gen)
    gen.next()  # before the trace begins (a warm-up's step): not on any line
    steps = StepTrace(str(path))
    now = time.perf_counter()
    steps.turn(now, now + 0.002, batch=4, ended=0, passes=0, idle_reads=0)
    gen.next()
    steps.turn(now, now + 0.005, batch=4, ended=1, passes=2, idle_reads=1)
    steps.turn(now, now + 0.001, batch=3, ended=0, passes=2, idle_reads=1)
    steps.turn(now, now + 0.001, batch=3, ended=0, passes=3, idle_reads=1)
    steps.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line.get("passes"), line.get("idle_reads")) for line in lines] == [(None, None), (2, 1), (None, None),
                                                                                  (1, None)]
    assert [line.get("ended") for line in lines] == [None, 1, None, None]
    assert ["next_ms" in line for line in lines] == [False, True, False, False]
    assert 3.0 <= lines[1]["next_ms"] < 1000 and lines[1]["ms"] == 5.0 and lines[0]["batch"] == 4


def test_without_the_trace_the_generator_is_left_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLXD_TRACE_STEPS", raising=False)
    gen = Generator()
    trace.time_steps(gen)
    assert "next" not in vars(gen)  # no wrapper: the class's own method


def test_each_line_has_the_turns_own_peak_memory(tmp_path: Path) -> None:
    import mlx.core as mx

    path = tmp_path / "steps.jsonl"
    before = mx.zeros((64, 2**20), dtype=mx.float32)  # 256 MiB before the trace begins (a warm-up's)
    mx.eval(before)
    del before
    steps = StepTrace(str(path))
    now = time.perf_counter()
    steps.turn(now, now + 0.001, batch=1)  # what came before the trace is not on this line
    big = mx.zeros((64, 2**20), dtype=mx.float32)  # 256 MiB, made in the next turn
    mx.eval(big)
    steps.turn(now, now + 0.001, batch=1)
    del big
    steps.turn(now, now + 0.001, batch=1)
    steps.close()
    peaks = [json.loads(line)["peak_mb"] for line in path.read_text().splitlines()]
    assert peaks[0] < peaks[1] - 200 and peaks[1] >= 268 and peaks[2] < peaks[1] - 200, peaks


def test_a_turns_parts_are_timed_into_its_line_only_when_tracing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "steps.jsonl"
    monkeypatch.setattr(trace, "_on", True)
    steps = StepTrace(str(path))
    now = time.perf_counter()
    for _ in range(2):  # two chunks in one turn: summed
        with trace.part("chunk"):
            time.sleep(0.004)
    with pytest.raises(ValueError), trace.part("token"):  # timed however it ends
        raise ValueError
    steps.turn(now, now + 0.01, serial=1)
    steps.turn(now, now + 0.001, serial=1)  # nothing timed in this turn
    monkeypatch.setattr(trace, "_on", False)
    with trace.part("chunk"):
        time.sleep(0.004)
    steps.turn(now, now + 0.001, serial=1)
    steps.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert 8.0 <= lines[0]["chunk_ms"] < 1000 and "token_ms" in lines[0], lines[0]
    assert "chunk_ms" not in lines[1] and "chunk_ms" not in lines[2], lines
