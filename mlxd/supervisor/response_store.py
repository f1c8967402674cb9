"""The Responses API's store: stored responses outlive any engine and any restart.

One SQLite file in the data dir (`responses.sqlite3`), in WAL mode with `synchronous=NORMAL`:
a committed write survives the supervisor being killed (SIGKILL included; a power cut may
lose the last ones). The schema carries a version (`PRAGMA user_version`); a file of a newer
version is refused rather than misread.

A row is one response: its own input items, its output items and the response object (JSON,
as the API returns it), the id of the response it continued (`previous_response_id`), its
size, and when it was created, last used and expires. `chain(id)` walks `previous_id` links
back to the first response and gives every turn's input and output in order: what a request
chaining on `id` is prepended with. A turn stores only its own items, so a long chain costs
its length in rows, not its square.

Limits: a TTL (rows past `expires_at` are gone at the next write and never returned) and a
byte cap over all rows, evicting the least recently used first. Calls block (SQLite is
fast, but a write waits for the disk): the supervisor runs them on the store's own thread
(`AsyncStore`), one at a time, so chains written concurrently on one id cannot interleave.
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec

SCHEMA_VERSION = 1
DEFAULT_TTL_S = 30 * 24 * 3600
DEFAULT_CAP_BYTES = 1024**3
MAX_CHAIN = 10_000  # turns followed back; a longer chain (or a loop) is refused

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    previous_id TEXT,
    model TEXT NOT NULL,
    created_at REAL NOT NULL,
    used_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    size INTEGER NOT NULL,
    input BLOB NOT NULL,
    output BLOB NOT NULL,
    response BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_used ON responses (used_at);
CREATE INDEX IF NOT EXISTS responses_expires ON responses (expires_at);
CREATE TABLE IF NOT EXISTS generations (
    id TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    created_at REAL NOT NULL,
    request BLOB NOT NULL,
    chat BLOB NOT NULL,
    tokens BLOB NOT NULL,
    segments BLOB NOT NULL
);
"""


class StoreError(Exception):
    """The store's file cannot be used (a newer schema, not SQLite)."""


class ChainBroken(Exception):
    """A response in the chain is gone (deleted, expired, evicted) or the chain loops."""

    def __init__(self, missing: str) -> None:
        super().__init__(missing)
        self.missing = missing


@dataclass(frozen=True, slots=True)
class Stored:
    id: str
    previous_id: str | None
    model: str
    created_at: float
    input: list[Any]  # this turn's input items
    output: list[Any]  # its output items
    response: dict[str, Any]  # the response object as returned


@dataclass(frozen=True, slots=True)
class Generation:
    """A stored response still being made, or cut off by a restart (its row goes when it is stored)."""

    id: str
    model: str
    created_at: float
    request: bytes  # the Responses request, as sent
    chat: bytes  # the chat request the engine was sent
    tokens: list[int]  # the reply's token ids delivered, as last saved
    segments: list[int]  # how they were split into the writes that carried them


class ResponseStore:
    """The store itself: blocking calls, one thread at a time (see AsyncStore)."""

    def __init__(self, path: Path | None, ttl_s: float = DEFAULT_TTL_S, cap_bytes: int = DEFAULT_CAP_BYTES,
                 clock: Callable[[], float] = time.time) -> None:
        """`path` None: in memory (an app made without a data dir, in tests)."""
        self.path = path
        self.ttl_s = ttl_s
        self.cap_bytes = cap_bytes
        self._clock = clock
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(str(path or ":memory:"), isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{path} is not a response store: {exc}") from None
        if version > SCHEMA_VERSION:
            raise StoreError(f"{path} has schema version {version}; this mlxd reads up to {SCHEMA_VERSION}")
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        self._bytes = int(self._db.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()[0])

    def close(self) -> None:
        self._db.close()

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def put(self, id: str, previous_id: str | None, model: str, input: list[Any], output: list[Any],
            response: dict[str, Any]) -> None:
        """Store a response (committed when this returns); then drop what is past the TTL or cap."""
        now = self._clock()
        blobs = [msgspec.json.encode(x) for x in (input, output, response)]
        size = sum(len(b) for b in blobs) + len(id) + 64
        with self._transaction():
            old = self._db.execute("SELECT size FROM responses WHERE id = ?", (id,)).fetchone()
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (id, previous_id, model, now, now, now + self.ttl_s, size, *blobs),
            )
            self._bytes += size - (old[0] if old else 0)
            self._db.execute("DELETE FROM generations WHERE id = ?", (id,))
            self._expire(now)
            self._evict(keep=id)

    # --- generations: stored responses not finished yet ------------------------------------------

    def begin(self, id: str, model: str, created_at: float, request: bytes, chat: bytes) -> None:
        """A stored response starts being made (so a restart that cuts it off leaves it resumable)."""
        self._db.execute("INSERT OR REPLACE INTO generations VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (id, model, created_at, request, chat, b"", b""))

    def progress(self, id: str, tokens: bytes, segments: bytes) -> None:
        """What of it was delivered so far: token ids and segment lengths, as little-endian int64s."""
        self._db.execute("UPDATE generations SET tokens = ?, segments = ? WHERE id = ?", (tokens, segments, id))

    def end(self, id: str) -> None:
        """It ended without being stored (an error): nothing to go on with."""
        self._db.execute("DELETE FROM generations WHERE id = ?", (id,))

    def generation(self, id: str) -> Generation | None:
        """A response being made, or cut off, and not past the TTL."""
        row = self._db.execute(
            "SELECT id, model, created_at, request, chat, tokens, segments FROM generations "
            "WHERE id = ? AND created_at > ?", (id, self._clock() - self.ttl_s)).fetchone()
        if row is None:
            return None
        rid, model, created_at, request, chat, tokens, segments = row
        return Generation(rid, model, created_at, bytes(request), bytes(chat), _ints(tokens), _ints(segments))

    def get(self, id: str) -> Stored | None:
        """The response, or None if it never was, was deleted or has expired; marks it used."""
        now = self._clock()
        stored = self._fetch(id, now)
        if stored is not None:
            self._db.execute("UPDATE responses SET used_at = ? WHERE id = ?", (now, id))
        return stored

    def chain(self, id: str) -> list[Stored]:
        """The responses from the first of the chain to `id`, in order; ChainBroken naming the
        first one missing (`id` itself included). All are marked used, in one commit."""
        now = self._clock()
        out: list[Stored] = []
        seen: set[str] = set()
        current: str | None = id
        with self._transaction():
            while current is not None:
                if current in seen or len(out) >= MAX_CHAIN:
                    raise ChainBroken(current)
                seen.add(current)
                stored = self._fetch(current, now)
                if stored is None:
                    raise ChainBroken(current)
                out.append(stored)
                current = stored.previous_id
            self._db.executemany("UPDATE responses SET used_at = ? WHERE id = ?", [(now, s.id) for s in out])
        out.reverse()
        return out

    def _fetch(self, id: str, now: float) -> Stored | None:
        row = self._db.execute(
            "SELECT id, previous_id, model, created_at, input, output, response FROM responses "
            "WHERE id = ? AND expires_at > ?", (id, now)).fetchone()
        return _stored(row) if row is not None else None

    def delete(self, id: str) -> bool:
        with self._transaction():
            row = self._db.execute("DELETE FROM responses WHERE id = ? RETURNING size", (id,)).fetchone()
            if row is not None:
                self._bytes -= row[0]
        return row is not None

    def _expire(self, now: float) -> None:
        rows = self._db.execute("DELETE FROM responses WHERE expires_at <= ? RETURNING size", (now,)).fetchall()
        self._bytes -= sum(r[0] for r in rows)
        self._db.execute("DELETE FROM generations WHERE created_at <= ?", (now - self.ttl_s,))

    def _evict(self, keep: str) -> None:
        """Least recently used first, until under the cap (never the row just written)."""
        while self._bytes > self.cap_bytes:
            rows = self._db.execute(
                "SELECT id, size FROM responses WHERE id != ? ORDER BY used_at LIMIT 64", (keep,)).fetchall()
            if not rows:
                return
            for rid, size in rows:
                self._db.execute("DELETE FROM responses WHERE id = ?", (rid,))
                self._bytes -= size
                if self._bytes <= self.cap_bytes:
                    return

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        self._db.execute("COMMIT" if kind is None else "ROLLBACK")


def _ints(blob: bytes) -> list[int]:
    values = array.array("q")
    values.frombytes(bytes(blob))
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


def int_blob(values: array.array[int]) -> bytes:
    """`values` (an array of "q") as `progress` stores them."""
    if sys.byteorder == "little":
        return values.tobytes()
    swapped = array.array("q", values)
    swapped.byteswap()
    return swapped.tobytes()


def _stored(row: tuple[Any, ...]) -> Stored:
    rid, previous_id, model, created_at, input_, output, response = row
    return Stored(rid, previous_id, model, created_at, msgspec.json.decode(input_), msgspec.json.decode(output),
                  msgspec.json.decode(response))


class AsyncStore:
    """The store for the event loop: each call runs on the store's one thread."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mlxd-store")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.submit(fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue a call now (calls run in the order they are queued) without waiting for it."""
        return asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def close(self) -> None:
        self._thread.submit(self.store.close).result()
        self._thread.shutdown()
