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

import importlib
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


# Each job kind's function, "module:name", imported only for the job that runs it (mlx-lm's
# tools are slow to import, and a push or a dataset job needs none of them).
KINDS = {
    "finetune": "mlxd.lab.finetune:finetune",
    "quantize": "mlxd.lab.quantize:quantize",
    "fuse": "mlxd.lab.fuse:fuse",
    "merge": "mlxd.lab.fuse:merge",
    "dataset": "mlxd.lab.dataset:dataset",
    "push": "mlxd.lab.push:push",
}


def run(job: WorkerJob, emit: Emit) -> Made:
    target = KINDS.get(job.kind)
    if target is None:
        raise JobError(f"unknown job kind {job.kind!r}")
    module, name = target.split(":")
    made: Made = getattr(importlib.import_module(module), name)(job, emit)
    return made


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
