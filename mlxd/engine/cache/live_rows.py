"""Which checkpoints belong to replies still running: kept beside the SSD tier so that the
next engine of the model restores them while it starts (docs/resume.md).

An engine that dies mid-reply leaves its replies' generation checkpoints on SSD; the
supervisor then continues each reply on the next engine, whose first job is that reply's
prompt plus what was delivered. Found on SSD at that moment, the checkpoint is restored in the
new engine's queue (on an H100, 150 ms for the 600 MB of a 4,500-token prompt, a quarter of
its cold prefill). Restored while the new engine starts, it is in the RAM tier when the
continuation comes.

Each engine with checkpoints on writes `live-<pid>.json` in its tier's dir: for each running
row that has a checkpoint (and the last few cut off: gpu/checkpoints.py), that checkpoint's
file name, the one before and the whole file a delta of it rests on, newest first. It is
rewritten (to a temp file, then renamed over it) when a row checkpoints or ends. Beside it, `live-<pid>.lock` stays locked (`flock`) for the engine's
life: the kernel drops the lock when the process dies, however it dies, so a lock that can be
taken marks a dead engine, whatever has become of its pid. An engine that starts reads the
lists of dead engines (`interrupted`), deletes them, and restores what they name
(`restore_interrupted`). An engine that stops cleanly leaves its list too: the rows it names
were cut by the stop, and may be continued on the next engine.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxd.engine.cache.prefix_cache import PrefixCache

log = logging.getLogger("mlxd.engine")
PREFIX = "live-"
MAX_AGE_S = 3600.0  # a list untouched for longer names replies nobody is coming back for


class LiveRows:
    """This engine's list of running rows' checkpoints (GPU thread)."""

    def __init__(self, dir_: Path) -> None:
        self._path = dir_ / f"{PREFIX}{os.getpid()}.json"
        self._lock_path = self._path.with_suffix(".lock")
        self._lock_fd: int | None = None
        self._shown: list[list[str]] | None = None
        try:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._lock_fd = fd
        except OSError as exc:
            log.warning("checkpoints: cannot lock %s (%s): the next engine will not restore them early",
                        self._lock_path, exc)

    def show(self, rows: list[list[str]]) -> None:
        """Name these rows' checkpoints (each row's names newest first) as the running ones."""
        if self._lock_fd is None or rows == self._shown:
            return
        temp = self._path.with_name(f".{self._path.name}.tmp")
        try:
            temp.write_text(json.dumps(rows))
            os.replace(temp, self._path)
            self._shown = rows
        except OSError as exc:  # disk full, say: the restore then happens when the reply comes back
            log.warning("checkpoints: cannot write %s: %s", self._path, exc)


def interrupted(dir_: Path, max_age_s: float = MAX_AGE_S) -> list[list[str]]:
    """The rows that dead engines were running when they died (each row's checkpoint names,
    newest first), the most recently written lists first; their lists are deleted. Lists of
    engines still running are left alone; lists older than `max_age_s` are deleted unread."""
    found: list[tuple[float, list[list[str]]]] = []
    own = f"{PREFIX}{os.getpid()}.json"
    for path in dir_.glob(f"{PREFIX}*.json"):
        if path.name == own:
            continue
        lock_path = path.with_suffix(".lock")
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its engine runs
            mtime = 0.0
            try:
                mtime = path.stat().st_mtime
                rows = json.loads(path.read_text()) if time.time() - mtime <= max_age_s else []
            except (OSError, ValueError) as exc:
                log.warning("checkpoints: %s unreadable (%s); deleted", path.name, exc)
                rows = []
            if _valid(rows):
                found.append((mtime, rows))
            for stale in (path, lock_path):
                with contextlib.suppress(OSError):
                    stale.unlink()
        finally:
            os.close(fd)
    found.sort(key=lambda f: f[0], reverse=True)
    return [row for _, rows in found for row in rows]


def _valid(rows: object) -> bool:
    return isinstance(rows, list) and all(
        isinstance(row, list) and row and all(isinstance(n, str) and "/" not in n for n in row) for row in rows)


def restore_interrupted(cache: PrefixCache) -> int:
    """Restore into the RAM tier, while it has room, the newest checkpoint the SSD tier holds
    of each row a dead engine was running (GPU thread, at start): how many were restored. Not
    in an engine group, whose ranks must agree on which entries a lookup may use."""
    ssd = cache.ssd
    if ssd is None or cache.only_disk is not None:
        return 0
    started = time.perf_counter()
    count = nbytes = 0
    try:
        rows = interrupted(ssd.dir)
        on_disk = {d.name: d for d in ssd.entries()}
        for names in rows:
            d = next((on_disk[n] for n in names if n in on_disk), None)
            if d is None:
                continue
            got = cache.restore_early(d, ssd.chain_size(d))
            count, nbytes = count + (got > 0), nbytes + got
    except Exception:  # never the engine's start: the continuations restore them as they come
        log.exception("checkpoints: restoring a stopped engine's running replies failed")
        return count
    if not rows:
        return 0
    log.info("checkpoints: %d of the %d replies a stopped engine was running restored to RAM ahead of "
             "their continuations (%.1f MB, %.0f ms)", count, len(rows), nbytes / 1e6,
             (time.perf_counter() - started) * 1000)
    return count
