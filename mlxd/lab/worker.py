"""A lab job's worker process: reads JOB_DIR/job.json, runs the job, reports as it goes.

Reports are JSON lines appended to JOB_DIR/events.jsonl (protocol/jobs.py: progress, then what
it made or why it failed), flushed line by line, so that a supervisor that restarted meanwhile
can read them as well as the one that started it. Everything else it says (mlx-lm's own output,
tracebacks) goes to stderr, which the supervisor sends to the job's log. The worker runs in a
session of its own: a supervisor that dies does not take it along; SIGTERM cancels it.

What it makes is written to a temporary dir beside its destination and renamed into place
only once complete, so a cancelled or failed job leaves no half-made adapter or model where
the registry would find it.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import msgspec

from mlxd.protocol.jobs import Failure, Made, Progress, WorkerJob

log = logging.getLogger("mlxd.lab")
Emit = Callable[[Progress], None]
JOB_FILE = "job.json"
EVENTS_FILE = "events.jsonl"


class JobError(Exception):
    """The job cannot be done for a reason the user can fix; the message says which."""


class Events:
    """The job's events file: one JSON line each, flushed as written."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("ab", buffering=0)

    def write(self, line: Progress | Made | Failure) -> None:
        self._file.write(msgspec.json.encode(line) + b"\n")


def staging_dir(final: Path) -> Path:
    """The temporary dir beside `final` that the job writes into (hidden: no scan lists it)."""
    return final.parent / f".{final.name}.partial-{os.getpid()}"


def publish(staged: Path, final: Path) -> None:
    """Move a finished output into place (a name taken meanwhile is a JobError)."""
    if final.exists():
        raise JobError(f"{final} exists already; choose another name")
    staged.rename(final)


def run(job: WorkerJob, emit: Emit) -> Made:
    if job.kind == "finetune":
        from mlxd.lab.finetune import finetune

        return finetune(job, emit)
    if job.kind == "quantize":
        from mlxd.lab.quantize import quantize

        return quantize(job, emit)
    if job.kind == "fuse":
        from mlxd.lab.fuse import fuse

        return fuse(job, emit)
    if job.kind == "merge":
        from mlxd.lab.fuse import merge

        return merge(job, emit)
    if job.kind == "dataset":
        from mlxd.lab.dataset import dataset

        return dataset(job, emit)
    if job.kind == "push":
        from mlxd.lab.push import push

        return push(job, emit)
    raise JobError(f"unknown job kind {job.kind!r}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m mlxd.lab JOB_DIR", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    job_dir = Path(argv[0])
    events = Events(job_dir / EVENTS_FILE)
    job = msgspec.json.decode((job_dir / JOB_FILE).read_bytes(), type=WorkerJob)
    staged = staging_dir(Path(job.output_path)) if job.kind != "push" else None  # a push writes nothing here
    try:
        made = run(job, events.write)
    except JobError as exc:
        events.write(Failure(error=str(exc)))
        return 1
    except Exception as exc:
        traceback.print_exc()
        events.write(Failure(error=f"{type(exc).__name__}: {exc}"))
        return 1
    finally:
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
    events.write(made)
    return 0
