"""The spinner `mlxd run` shows until an answer's first token: elapsed time, and the model's load
progress while its engine starts (the `load` field of `GET /v1/models`, polled at 4 Hz)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from mlxd.cli.admin.client import AdminClient, AdminError
from mlxd.cli.chat.answer import format_duration
from mlxd.protocol.stats import PHASE_NAMES
from mlxd.protocol.units import format_size

POLL_INTERVAL_S = 0.25
SHOW_AFTER_S = 0.2
POLL_TIMEOUT_S = 2.0
BAR_WIDTH = 30


@dataclass(frozen=True)
class LoadStatus:
    """What `GET /v1/models` says about one model while we wait for it."""

    state: str = "stopped"
    phase: str | None = None
    done: int = 0
    total: int | None = None
    unit: str | None = None


def find_model(listing: Mapping[str, Any], model: str) -> Mapping[str, Any] | None:
    """The /v1/models entry a request's `model` names, looked up as the daemon does: the exact id,
    else the id in any case, else a unique repo name without its org (Registry._lookup)."""
    entries = [e for e in listing.get("data") or () if isinstance(e, Mapping) and isinstance(e.get("id"), str)]
    folded = model.casefold()
    for matches in ([e for e in entries if e["id"] == model], [e for e in entries if e["id"].casefold() == folded]):
        if matches:
            return matches[0]
    short = [e for e in entries if e["id"].rpartition("/")[2].casefold() == folded]
    return short[0] if len(short) == 1 else None


def load_status(listing: Mapping[str, Any], model: str) -> LoadStatus | None:
    """The model's state and load progress from a /v1/models answer; None if it is not listed.

    A missing or null `load` means no progress to show (older daemons have no such field).
    """
    if (entry := find_model(listing, model)) is None:
        return None
    load = entry.get("load")
    if not isinstance(load, Mapping):
        return LoadStatus(state=str(entry.get("state") or "stopped"))
    total = load.get("total")
    return LoadStatus(state=str(entry.get("state") or "starting"), phase=load.get("phase"),
                      done=int(load.get("done") or 0), total=int(total) if total else None, unit=load.get("unit"))


def wait_text(model: str, status: LoadStatus | None, elapsed_s: float) -> str:
    """The words beside the spinner."""
    clock = format_duration(elapsed_s)
    if status is None or status.state != "starting":
        return f"waiting for {model} · {clock}"
    if status.phase is None:
        return f"starting {model} · {clock}"
    what = PHASE_NAMES.get(status.phase, status.phase)
    if status.total is None:
        amount = format_size(status.done) if status.unit == "bytes" and status.done else ""
    elif status.unit == "bytes":
        amount = f"{format_size(status.done)} / {format_size(status.total)}"
    else:
        amount = f"{status.done} / {status.total}"
    return f"loading {model}: {what}" + (f" {amount}" if amount else "") + f" · {clock}"


class WaitView:
    """The renderable: a spinner, the text, and a bar when the load's total is known."""

    def __init__(self, model: str, started: float) -> None:
        self.model, self.started = model, started
        self.status: LoadStatus | None = None
        self._spinner = Spinner("dots", style="cyan")

    def __rich__(self) -> RenderableType:
        status = self.status
        grid = Table.grid(padding=(0, 1))
        cells: list[RenderableType] = [self._spinner, Text(wait_text(self.model, status, time.monotonic() - self.started),
                                                           style="dim")]
        if status is not None and status.phase is not None and status.total:
            cells.insert(1, ProgressBar(total=status.total, completed=min(status.done, status.total), width=BAR_WIDTH))
        grid.add_row(*cells)
        return Group(grid)


class FirstTokenWait:
    """Shows the spinner on `console` once the wait passes SHOW_AFTER_S, and polls the model's load, until `stop()`."""

    def __init__(self, console: Console, client: AdminClient, model: str) -> None:
        self.view = WaitView(model, time.monotonic())
        self._client, self._model = client, model
        self._done = threading.Event()
        self._lock = threading.Lock()  # the poller starts the spinner; stop() must not race it
        self._live = Live(self.view, console=console, transient=True, refresh_per_second=10,
                          redirect_stdout=False, redirect_stderr=False)
        self._is_shown = False
        self._thread = threading.Thread(target=self._poll, name="mlxd-run-load", daemon=True)

    def start(self) -> FirstTokenWait:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Clear the spinner; the poller ends at its next wake-up (a poll in flight is left to time out)."""
        with self._lock:
            if self._done.is_set():
                return
            self._done.set()
            if self._is_shown:
                self._live.stop()

    def _poll(self) -> None:
        # A warm model answers before SHOW_AFTER_S: no spinner flashes, and no poll is made.
        if self._done.wait(SHOW_AFTER_S):
            return
        with self._lock:
            if self._done.is_set():
                return
            self._live.start()
            self._is_shown = True
        while not self._done.is_set():
            with contextlib.suppress(AdminError):  # the stream itself reports a daemon that went away
                self.view.status = load_status(self._client.get("/v1/models", timeout=POLL_TIMEOUT_S), self._model)
            self._done.wait(POLL_INTERVAL_S)
