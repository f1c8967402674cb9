"""The lab's job store (mlxd/supervisor/jobs/store.py) and the runner's reading of events."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxd.protocol.errors import APIError
from mlxd.protocol.jobs import Made, Progress
from mlxd.supervisor.jobs.runner import _read_lines
from mlxd.supervisor.jobs.store import MAX_LOSSES, JobStore


def test_a_job_goes_from_queued_to_one_end_and_keeps_its_losses(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    job = store.create("finetune", {"model": "m", "name": "a"})
    assert job.state == "queued" and job.request["name"] == "a" and store.dir_of(job.id).is_dir()
    store.started(job.id, 1234)
    for step in range(1, 4):
        store.progressed(job.id, Progress(stage="training", step=step, loss=1.0 / step))
    store.progressed(job.id, Progress(stage="training", step=3, val_loss=0.5))  # no loss: no point
    running = store.get(job.id)
    assert running is not None and running.state == "running" and running.pid == 1234
    assert running.losses == [[1.0, 1.0], [2.0, 0.5], [3.0, 1.0 / 3]] and running.progress.val_loss == 0.5
    store.finished(job.id, "succeeded", result=Made(kind="adapter", path="/x", name="a"))
    store.finished(job.id, "failed", "too late")  # an ended job stays ended
    done = store.get(job.id)
    assert done is not None and done.state == "succeeded" and done.result.name == "a" and done.error is None
    assert [j.id for j in store.in_state("succeeded")] == [job.id] and store.in_state("queued") == []
    store.close()
    again = JobStore(tmp_path)
    assert again.get(job.id) is not None and [j.id for j in again.recent(kind="finetune")] == [job.id]
    assert again.recent(kind="quantize") == []


def test_the_loss_curve_is_thinned_past_its_cap(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    job = store.create("finetune", {})
    for step in range(MAX_LOSSES + 1):
        store.progressed(job.id, Progress(stage="training", step=step, loss=1.0))
    found = store.get(job.id)
    assert found is not None and len(found.losses) <= MAX_LOSSES // 2 + 1


def test_a_store_without_a_dir_lists_nothing_and_takes_no_jobs() -> None:
    store = JobStore(None)
    assert store.recent() == []
    with pytest.raises(APIError) as err:
        store.create("finetune", {})
    assert err.value.status == 503


def test_events_are_read_a_whole_line_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    assert _read_lines(path, 0) == (0, [])
    path.write_bytes(b'{"event":"progress","stage":"training","step":1}\nnot json\n{"event":"made","ki')
    offset, lines = _read_lines(path, 0)
    assert [type(x).__name__ for x in lines] == ["Progress"] and offset == path.read_bytes().index(b'{"event":"made')
    with path.open("ab") as f:
        f.write(b'nd":"adapter","path":"/a","name":"a"}\n')
    offset2, more = _read_lines(path, offset)
    assert isinstance(more[0], Made) and offset2 == path.stat().st_size
