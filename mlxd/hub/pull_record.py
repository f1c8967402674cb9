"""Which hub-cache repos `mlxd pull` downloaded: `pulled.json` in the data dir.

`mlxd rm` deletes a hub-cache repo only when this record names it, so that a repo another
tool put in the shared cache is never deleted by mlxd.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec

FILE_NAME = "pulled.json"


class Pull(msgspec.Struct, frozen=True, kw_only=True):
    """One repo `mlxd pull` fetched into one hub cache."""

    repo: str
    cache: str  # the hub cache dir it went into, resolved
    revision: str
    commit: str
    pulled_at: float


class PullFile(msgspec.Struct, kw_only=True):
    """The file's contents."""

    version: int = 1
    pulls: list[Pull] = msgspec.field(default_factory=list)


class PullRecord:
    """The pulls recorded in `<data dir>/pulled.json`; each change rewrites the file atomically."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / FILE_NAME

    def pulls(self) -> list[Pull]:
        """Every recorded pull; an unreadable or damaged file reads as none (nothing is then deleted)."""
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=PullFile).pulls
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return []

    def find(self, repo: str, cache: Path) -> Pull | None:
        """The record of `repo` pulled into `cache`, if any."""
        key = _cache_key(cache)
        return next((p for p in self.pulls() if p.repo == repo and p.cache == key), None)

    def add(self, repo: str, cache: Path, revision: str, commit: str) -> None:
        """Record that `repo` was pulled into `cache` (replacing an older record of it)."""
        pull = Pull(repo=repo, cache=_cache_key(cache), revision=revision, commit=commit, pulled_at=time.time())
        self._write([*self._others(repo, cache), pull])

    def remove(self, repo: str, cache: Path) -> None:
        """Forget `repo` in `cache`."""
        self._write(self._others(repo, cache))

    def _others(self, repo: str, cache: Path) -> list[Pull]:
        key = _cache_key(cache)
        return [p for p in self.pulls() if not (p.repo == repo and p.cache == key)]

    def _write(self, pulls: list[Pull]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{FILE_NAME}.{os.getpid()}")
        tmp.write_bytes(msgspec.json.format(msgspec.json.encode(PullFile(pulls=pulls))))
        os.replace(tmp, self.path)  # a reader never sees half a file


def _cache_key(cache: Path) -> str:
    """The cache dir as recorded: absolute, symlinks resolved, so two spellings of it match."""
    return str(cache.expanduser().resolve())
