"""A starting model's progress on the terminal: a bar where the total is known, else a spinner.

The daemon reports it in the `load` field of each `GET /admin/engines` row (phase, done, total,
unit, elapsed_s). `LoadProgress` polls it on a thread while `mlxd load` waits for the model and
draws it with rich, on stderr, only when stderr is a terminal. (`mlxd run` draws its own wait,
from `/v1/models`: chat_wait.py.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from mlxd.cli.admin.client import AdminClient, AdminError
from mlxd.protocol.stats import PHASE_NAMES, phase_words

POLL_S = 0.25

Reader = Callable[[], Mapping[str, Any] | None]  # the model's `load` now (None: not starting)


def engine_load(client: AdminClient, model: str) -> Reader:
    """A reader of `model`'s load progress from GET /admin/engines (admin key)."""

    def read() -> Mapping[str, Any] | None:
        rows = client.get("/admin/engines", timeout=5.0).get("data", [])
        row = next((r for r in rows if r.get("model") == model), None)
        load = row.get("load") if row else None
        return load if isinstance(load, Mapping) else None

    return read


def phase_text(load: Mapping[str, Any]) -> str:
    """`reading weights 45%` or `starting the engine 1.2 s`, for `mlxd ps` and the plain display."""
    total = load.get("total")
    if isinstance(total, int) and total > 0:
        return phase_words(str(load.get("phase")), int(load.get("done") or 0), total)
    text = phase_words(str(load.get("phase")), 0, None)
    return f"{text} {float(load.get('elapsed_s') or 0):.1f} s"


class LoadProgress:
    """While in its `with` block, polls `read` and draws the model's progress on stderr (a TTY)."""

    def __init__(self, model: str, read: Reader, enabled: bool) -> None:
        self.model, self._read, self._enabled = model, read, enabled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-progress", daemon=True)
        self._progress: Any = None

    def __enter__(self) -> LoadProgress:
        if self._enabled:
            from rich.console import (
                Console,  # imported only when drawn: `mlxd load --json` stays light
            )
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                      DownloadColumn(), TimeElapsedColumn(), console=Console(stderr=True),
                                      transient=True)
            self._progress.start()
            self._task = self._progress.add_task(f"{self.model}: waiting", total=None)
            self._phase: object = None
            self._thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._stop.set()
        if self._progress is not None:
            self._thread.join(timeout=1.0)
            self._progress.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                load = self._read()
            except AdminError:
                load = None  # the wait itself reports a daemon that stopped answering
            if load is not None and not self._stop.is_set():
                self._show(load)
            self._stop.wait(POLL_S)

    def _show(self, load: Mapping[str, Any]) -> None:
        phase = load.get("phase")
        if phase != self._phase:  # a task per phase: rich keeps a task's total once set
            self._phase = phase
            self._progress.remove_task(self._task)
            total = load.get("total") if load.get("unit") == "bytes" else None
            description = f"{self.model}: {PHASE_NAMES.get(str(phase), phase)}"
            self._task = self._progress.add_task(description, total=total)
        self._progress.update(self._task, completed=load.get("done") or 0)
