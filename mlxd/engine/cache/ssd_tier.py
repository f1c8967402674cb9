"""The SSD tier: prompt-cache entries as files, and the thread that writes them.

The tier's dir (`<data dir>/kv/<fingerprint>/`) holds one file an entry (kv_files.py), named
by a hash of its tokens. The index (tokens, size, last use) lives in memory and is rebuilt at
start from the files' headers; leftover temp files are deleted, and a file whose header is
not ours is moved to `quarantine/`. A file that fails its checksum when restored goes there
too, and the request is served as a miss. Past the byte cap the least recently used files
are deleted. Disk full or an I/O error: logged, counted, and serving goes on.

Threads: the GPU thread looks entries up and restores them; the writer thread (`Writer`)
adds the files it writes. The index is guarded by a lock; nothing here touches MLX except
`restore`, on the GPU thread.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlxd.engine.cache import kv_files
from mlxd.engine.cache.kv_files import CorruptFile, Tensor
from mlxd.protocol.stats import SsdTierStats

log = logging.getLogger("mlxd.engine")
QUARANTINE = "quarantine"
QUARANTINE_KEEP = 16  # newest quarantined files kept for a look; older ones are deleted
DEFAULT_SHARE = 0.25  # of the disk space free for it (free plus what the tier holds)
DEFAULT_MAX = 32 * 1024**3
MAX_LINKS = 64  # a delta's chain of bases, at most (gpu/checkpoints.py writes a whole file well before)


def default_ssd_cache_bytes(dir_: Path) -> int:
    """The tier's cap when none is set: a quarter of the space it could use, at most 32 GiB."""
    held = sum(p.stat().st_size for p in dir_.glob("*" + kv_files.SUFFIX))
    return int(min(DEFAULT_MAX, (shutil.disk_usage(dir_).free + held) * DEFAULT_SHARE))


@dataclass(slots=True, eq=False)
class DiskEntry:
    name: str
    tokens: np.ndarray  # int64
    size: int
    used: float  # last use (file mtime at scan)
    trimmable: bool = True  # serves a prefix of itself
    base: str | None = None  # a delta file's base (the file with the KV of its first `start` tokens)
    start: int = 0


@dataclass(slots=True)
class TierStats:
    """The SSD tier's counters (written under the tier's lock or by one thread each)."""

    writes: int = 0
    written_bytes: int = 0
    write_s: float = 0.0
    write_errors: int = 0
    restores: int = 0
    restored_bytes: int = 0
    restore_s: float = 0.0
    quarantined: int = 0
    evicted: int = 0


class SsdTier:
    def __init__(self, root: Path, cap_bytes: int) -> None:
        self.dir = root
        self.cap_bytes = cap_bytes
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._entries: dict[str, DiskEntry] = {}
        self.pinned: frozenset[str] = frozenset()  # never evicted (an engine group's ranks may use them next)
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="mlxd-ssd-verify")  # a restore's checksum
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._scan()

    # --- the index ----------------------------------------------------------------------------

    def _scan(self) -> None:
        """Rebuild the index from the dir: drop temp files, quarantine what is not ours."""
        for path in sorted(self.dir.iterdir()):
            if not path.is_file():
                continue
            if path.name.startswith(kv_files.TEMP_PREFIX):
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            if not path.name.endswith(kv_files.SUFFIX):
                continue
            try:
                header = kv_files.read_header(path)
                tokens = np.asarray(header.tokens, dtype=np.int64)
                trimmable, base = header.trimmable, header.base
                st = path.stat()
            except FileNotFoundError:
                continue  # gone since the listing
            except (CorruptFile, OSError, ValueError, OverflowError) as exc:
                self.quarantine(path, str(exc))
                continue
            self._entries[path.name] = DiskEntry(path.name, tokens, st.st_size, st.st_mtime, trimmable,
                                                 *(base or (None, 0)))
        for orphan in [e.name for e in self._entries.values() if e.base is not None and e.base not in self._entries]:
            self.remove(orphan)  # a delta whose base is gone serves nothing (nor the deltas on it)
        self._evict_over_cap()
        if self._entries:
            log.info("SSD prompt cache: %d entries, %.1f MB in %s", len(self._entries), self.bytes / 1e6, self.dir)

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(e.size for e in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def entries(self) -> list[DiskEntry]:
        with self._lock:
            return list(self._entries.values())

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._entries

    def get(self, name: str) -> DiskEntry | None:
        with self._lock:
            return self._entries.get(name)

    def chain(self, entry: DiskEntry) -> list[DiskEntry] | None:
        """A delta file's links, from the whole file it stands on to itself (a whole file: itself
        alone); None where a link is gone, cannot be cut or the chain runs past MAX_LINKS."""
        with self._lock:
            return self._chain(entry)

    def _chain(self, entry: DiskEntry) -> list[DiskEntry] | None:
        links = [entry]
        while links[-1].base is not None:
            base = self._entries.get(links[-1].base)
            if base is None or not base.trimmable or len(links) > MAX_LINKS or base in links:
                return None
            links.append(base)
        return links[::-1]

    def links(self, entry: DiskEntry) -> int:
        """The deltas in an entry's chain (0: a whole file; MAX_LINKS where the chain is broken)."""
        chain = self.chain(entry) if entry.base is not None else [entry]
        return len(chain) - 1 if chain is not None else MAX_LINKS

    def chain_size(self, entry: DiskEntry) -> int:
        """The bytes a restore of `entry` reads: its file's and its bases'."""
        links = self.chain(entry)
        return sum(e.size for e in links) if links is not None else entry.size

    def add(self, name: str, tokens: np.ndarray, size: int, trimmable: bool = True,
            base: tuple[str, int] | None = None) -> None:
        """A file the writer has just made durable; drop files it makes redundant (when it can
        serve their prefixes; a delta's bases stay), then the LRU ones over the cap."""
        with self._lock:
            entry = self._entries[name] = DiskEntry(name, tokens, size, time.time(), trimmable, *(base or (None, 0)))
            keep = {e.name for e in self._chain(entry) or [entry]}
            covered = [e for e in self._entries.values()
                       if trimmable and e.name not in keep and is_prefix(e.tokens, tokens)]
        for e in covered:
            self.remove(e.name)
        self._evict_over_cap()

    def remove(self, name: str) -> None:
        """Delete a file, and the delta files whose base it is."""
        with self._lock:
            self._entries.pop(name, None)
            dependents = [e.name for e in self._entries.values() if e.base == name]
        try:
            (self.dir / name).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("SSD prompt cache: cannot delete %s: %s", name, exc)
        for dependent in dependents:
            self.remove(dependent)

    def _evict_over_cap(self) -> None:
        while True:
            with self._lock:
                total = sum(e.size for e in self._entries.values())
                evictable = [e for e in self._entries.values() if e.name not in self.pinned]
                if total <= self.cap_bytes or not evictable:
                    return
                oldest = min(evictable, key=lambda e: e.used)
                self.stats.evicted += 1
            self.remove(oldest.name)

    # --- restore (GPU thread) -----------------------------------------------------------------

    def restore(self, entry: DiskEntry) -> list[Any] | None:
        """The entry's KV cache, checked against its checksum; None (and quarantined) if the
        file is damaged or gone.

        The checksum is checked in a thread while MLX loads the arrays (mlx-lm's
        `load_prompt_cache`, evaluated here: MLX's own reader, which on a GPU fills device
        memory itself); the cache is handed out only once the checksum agrees. A file whose
        header does not match its size never reaches MLX's reader."""
        import mlx.core as mx
        from mlx.utils import tree_flatten
        from mlx_lm.models.cache import load_prompt_cache

        if entry.base is not None:
            return self._restore_delta(entry)
        path = self.dir / entry.name
        started = time.perf_counter()
        try:
            kv_files.read_header(path)
            checking = self._checker.submit(kv_files.verify, path)
            load_error: Exception | None = None
            try:
                cache = load_prompt_cache(str(path))
                flat: list[tuple[str, Any]] = tree_flatten([c.state for c in cache])  # type: ignore[assignment]
                mx.eval([a for _, a in flat if isinstance(a, mx.array)])
            except Exception as exc:  # mlx could not read what the header promised
                load_error = exc
            checking.result()  # the checksum's verdict comes first: CorruptFile, FileNotFoundError
            if load_error is not None:
                raise load_error
        except FileNotFoundError:
            self.remove(entry.name)
            return None
        except Exception as exc:  # CorruptFile, or mlx could not parse what passed the checksum
            self.remove_to_quarantine(entry.name, str(exc))
            return None
        now = time.time()
        with contextlib.suppress(OSError):
            os.utime(path, (now, now))
        with self._lock:
            entry.used = now
            self.stats.restores += 1
            self.stats.restored_bytes += entry.size
            self.stats.restore_s += time.perf_counter() - started
        return list(cache)

    def _restore_delta(self, entry: DiskEntry) -> list[Any] | None:
        """A delta file's KV: the whole file it stands on, cut where the next link starts, and so
        on down the chain to its own arrays (each link a file: its checksum checked)."""
        import mlx.core as mx

        links = self.chain(entry)
        if links is None:  # a link is gone: the delta serves nothing
            self.remove(entry.name)
            return None
        parts = []
        for link in links:
            part = self.restore(dataclasses.replace(link, base=None))
            if part is None:
                return None
            parts.append(part)
        starts = [0, *(link.start for link in links[1:])]
        try:
            joined = [join(layer, starts) for layer in zip(*parts, strict=True)]
        except (ValueError, TypeError) as exc:
            self.remove_to_quarantine(entry.name, f"does not fit its base: {exc}")
            return None
        mx.eval([x for c in joined for x in (c.keys, c.values) if x is not None])
        for link in links:
            self.touch(link.name)  # (the restores above stamped copies of their index entries)
        return joined

    def touch(self, name: str) -> None:
        """Mark an entry used now (its RAM copy served a request)."""
        with self._lock:
            if (entry := self._entries.get(name)) is not None:
                entry.used = time.time()

    # --- quarantine ---------------------------------------------------------------------------

    def remove_to_quarantine(self, name: str, reason: str) -> None:
        with self._lock:
            self._entries.pop(name, None)
            dependents = [e.name for e in self._entries.values() if e.base == name]
        self.quarantine(self.dir / name, reason)
        for dependent in dependents:
            self.remove(dependent)

    def quarantine(self, path: Path, reason: str) -> None:
        """Move a damaged file aside (keeping the newest few for a look) and count it."""
        log.warning("SSD prompt cache: %s is damaged (%s); moved to %s/", path.name, reason, QUARANTINE)
        self.stats.quarantined += 1
        qdir = self.dir / QUARANTINE
        try:
            qdir.mkdir(exist_ok=True, mode=0o700)
            os.replace(path, qdir / f"{time.time_ns()}-{path.name}")
            kept = sorted(qdir.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
            for old in kept[QUARANTINE_KEEP:]:
                old.unlink()
        except OSError:
            with contextlib.suppress(OSError):
                path.unlink()

    def snapshot(self) -> SsdTierStats:
        s = self.stats
        with self._lock:
            entries, size = len(self._entries), sum(e.size for e in self._entries.values())
        return SsdTierStats(
            dir=str(self.dir), entries=entries, bytes=size, cap_bytes=self.cap_bytes, writes=s.writes,
            written_bytes=s.written_bytes, write_ms=round(s.write_s * 1000, 3), write_errors=s.write_errors,
            restores=s.restores, restored_bytes=s.restored_bytes, restore_ms=round(s.restore_s * 1000, 3),
            quarantined=s.quarantined, evicted=s.evicted,
        )


def join(parts: Any, starts: list[int]) -> Any:
    """One layer's cache from a chain's files, loaded: each part's KV from its start (`starts`,
    the first 0) up to the next part's, then all of the last part's."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    first = parts[0]
    if any(type(p) is not type(first) for p in parts) or type(first) not in (KVCache, QuantizedKVCache):
        raise TypeError(f"cannot join {', '.join(type(p).__name__ for p in parts)}")
    spans = [b - a for a, b in itertools.pairwise(starts)]
    for part, span in zip(parts, spans, strict=False):
        if span <= 0 or part.offset < span:
            raise ValueError(f"a file holds {part.offset} tokens where its chain needs {span}")
    out = copy.copy(parts[-1])

    def cat(arrays: list[Any]) -> Any:
        if isinstance(arrays[0], tuple):
            return tuple(cat(list(xs)) for xs in zip(*arrays, strict=True))
        cut = [a[..., :span, :] for a, span in zip(arrays, spans, strict=False)]
        return mx.concatenate([*cut, arrays[-1][..., : parts[-1].offset, :]], axis=2)

    out.keys, out.values = cat([p.keys for p in parts]), cat([p.values for p in parts])
    out.offset = starts[-1] + parts[-1].offset
    return out


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def is_prefix(short: np.ndarray, long: np.ndarray) -> bool:
    return len(short) <= len(long) and bool(np.array_equal(long[: len(short)], short))


@dataclass(slots=True, eq=False)
class WriteJob:
    """One entry to write: host buffers taken on the GPU thread (kept alive by `owner`)."""

    name: str
    tokens: np.ndarray
    cache_meta: dict[str, str]
    tensors: list[Tensor]
    urgent: bool  # an eviction or a drain: write even while the GPU is busy
    owner: Any = None  # the arrays the buffers point into
    done: Callable[[bool], None] = field(default=lambda ok: None)  # writer thread, after
    nbytes: int = 0  # the memory the job holds until written
    trimmable: bool = True
    base: tuple[str, int] | None = None  # a delta file's base and start (kv_files.Header.base)
    ready: Callable[[], bool] | None = None  # writer thread, before: wait for the buffers (False: never came)
    release: Callable[[], None] | None = None  # writer thread, after, but for buffers that never came


class Writer:
    """The thread that writes entries to the tier, one at a time.

    Write-behind jobs wait between chunks while the GPU loop is busy (`idle` cleared), so a
    write never competes with decoding; urgent jobs (evictions, drains) do not wait.
    """

    def __init__(self, tier: SsdTier, idle: threading.Event) -> None:
        self.tier = tier
        self._idle = idle
        self._jobs: queue.SimpleQueue[WriteJob | None] = queue.SimpleQueue()
        self._pending = 0  # jobs submitted and not yet done
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._hurry = 0  # > 0 while a flush waits: every job is urgent
        self._urgent_queued = 0  # urgent jobs not yet started: a paused write-behind job gives way
        self._thread = threading.Thread(target=self._run, name="mlxd-ssd-writer", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    @property
    def pending_bytes(self) -> int:
        with self._cond:
            return self._pending_bytes

    def submit(self, job: WriteJob) -> None:
        with self._cond:
            self._pending += 1
            self._pending_bytes += job.nbytes
            self._urgent_queued += job.urgent
        self._jobs.put(job)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted job is written (writing all of them now); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._hurry += 1
            try:
                while self._pending:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._hurry -= 1

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.urgent:
                with self._cond:
                    self._urgent_queued -= 1
            came = job.ready is None or job.ready()
            if not came:  # the GPU never made the bytes (it is gone): their memory is never reused
                log.warning("SSD prompt cache: a checkpoint's bytes never reached the host; not written")
            ok = came and self._write(job)
            try:
                if came and job.release is not None:
                    job.release()
                job.done(ok)
            except Exception:
                log.exception("SSD prompt cache: after-write callback failed")
            nbytes = job.nbytes
            # Its buffers and its callback's entry must not outlive the write (the loop variable
            # lives on while the next get() blocks).
            job.owner = job.tensors = job.done = job.ready = job.release = None  # type: ignore[assignment]
            del job
            with self._cond:
                self._pending -= 1
                self._pending_bytes -= nbytes
                self._cond.notify_all()

    def _pause(self, job: WriteJob) -> None:
        # A write-behind job waits while the GPU is busy, unless a flush or an eviction's write
        # waits behind it (it is finished first: the queue is in order).
        while not (job.urgent or self._hurry or self._urgent_queued or self._idle.is_set()):
            self._idle.wait(0.05)

    def _write(self, job: WriteJob) -> bool:
        tier = self.tier
        if job.name in tier:
            return True
        if job.base is not None and job.base[0] not in tier:
            return False  # its base did not reach the disk, or is gone: the delta would serve nothing
        started = time.perf_counter()
        try:
            size = kv_files.write_file(tier.dir, job.name, job.tokens.tolist(), job.cache_meta, job.tensors,
                                       pause=lambda: self._pause(job), trimmable=job.trimmable, base=job.base)
            tier.stats.writes += 1
            tier.stats.written_bytes += size
            tier.stats.write_s += time.perf_counter() - started
            tier.add(job.name, job.tokens, size, job.trimmable, job.base)
        except Exception as exc:  # disk full, I/O error; anything else must not end the writer either
            tier.stats.write_errors += 1
            log.warning("SSD prompt cache: could not write an entry (%s: %s); serving goes on",
                        type(exc).__name__, exc)
            return False
        return True
