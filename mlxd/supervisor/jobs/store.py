"""The job store: every lab job and its state, in SQLite in the data dir (`jobs/jobs.sqlite3`).

States run queued -> running -> succeeded | failed | cancelled. Each job also has a dir
(`jobs/<id>/`: its request, its worker's log and its events) that outlives the supervisor, so
a supervisor that starts again finds what was running and either adopts it (its worker still
lives) or marks it failed, saying why (runner.py).
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from pathlib import Path
from typing import Any

import msgspec

from mlxd.protocol.errors import APIError
from mlxd.protocol.jobs import Job, JobState, Made, Progress

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    request TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL,
    pid INTEGER,
    progress TEXT,
    losses TEXT NOT NULL DEFAULT '[]',
    error TEXT,
    result TEXT,
    log_path TEXT
)
"""
MAX_LOSSES = 2000  # loss points kept per job (the chart's): every other one dropped past that


class JobStore:
    """Jobs in SQLite (loop thread only: each call is one small statement)."""

    def __init__(self, root: Path | None) -> None:
        """The store in `root` (None: in memory, taking no jobs: an app made without a data dir)."""
        self._root = root
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(root / "jobs.sqlite3" if root is not None else ":memory:", isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(SCHEMA)

    def close(self) -> None:
        self._db.close()

    @property
    def root(self) -> Path:
        if self._root is None:
            raise APIError(503, "This supervisor keeps no jobs (it has no data dir).", type="server_error")
        return self._root

    def dir_of(self, job_id: str) -> Path:
        return self.root / job_id

    def create(self, kind: str, request: dict[str, Any]) -> Job:
        job_id = f"job_{secrets.token_hex(8)}"
        job_dir = self.dir_of(job_id)
        job_dir.mkdir(parents=True)
        log_path = job_dir / "log.txt"
        now = time.time()
        self._db.execute("INSERT INTO jobs (id, kind, state, request, created_at, log_path) VALUES (?, ?, ?, ?, ?, ?)",
                         (job_id, kind, "queued", msgspec.json.encode(request).decode(), now, str(log_path)))
        job = self.get(job_id)
        assert job is not None
        return job

    def get(self, job_id: str) -> Job | None:
        row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _job(row) if row is not None else None

    def recent(self, limit: int = 50, kind: str | None = None) -> list[Job]:
        query, args = "SELECT * FROM jobs", tuple[str, ...]()
        if kind is not None:
            query, args = query + " WHERE kind = ?", (kind,)
        rows = self._db.execute(query + " ORDER BY created_at DESC LIMIT ?", (*args, limit)).fetchall()
        return [_job(r) for r in rows]

    def in_state(self, *states: JobState) -> list[Job]:
        marks = ",".join("?" * len(states))
        rows = self._db.execute(f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY created_at", states).fetchall()
        return [_job(r) for r in rows]

    def started(self, job_id: str, pid: int) -> None:
        self._db.execute("UPDATE jobs SET state = 'running', started_at = ?, pid = ? WHERE id = ?",
                         (time.time(), pid, job_id))

    def progressed(self, job_id: str, progress: Progress) -> None:
        job = self.get(job_id)
        if job is None:
            return
        losses = job.losses
        if progress.loss is not None and progress.step is not None:
            losses.append([float(progress.step), progress.loss])
            if len(losses) > MAX_LOSSES:
                losses = losses[::2]
        self._db.execute("UPDATE jobs SET progress = ?, losses = ? WHERE id = ?",
                         (msgspec.json.encode(progress).decode(), msgspec.json.encode(losses).decode(), job_id))

    def finished(self, job_id: str, state: JobState, error: str | None = None, result: Made | None = None) -> None:
        self._db.execute(
            "UPDATE jobs SET state = ?, ended_at = ?, error = ?, result = ? WHERE id = ? AND state IN ('queued', 'running')",
            (state, time.time(), error, msgspec.json.encode(result).decode() if result is not None else None, job_id))


def _job(row: tuple[Any, ...]) -> Job:
    (job_id, kind, state, request, created, started, ended, pid, progress, losses, error, result, log_path) = row
    return Job(
        id=job_id, kind=kind, state=state, request=msgspec.json.decode(request), created_at=created,
        started_at=started, ended_at=ended, pid=pid,
        progress=msgspec.json.decode(progress, type=Progress) if progress else None,
        losses=msgspec.json.decode(losses), error=error,
        result=msgspec.json.decode(result, type=Made) if result else None, log_path=log_path,
    )
