"""Deleting a model mlxd owns: one in its models dir, or a hub-cache repo `mlxd pull` fetched
(pull_record.py says which). A repo another tool put in the shared hub cache, and a model
configured by path, are never deleted. Used by `mlxd rm` and Ollama's `DELETE /api/delete`;
imports neither huggingface_hub nor aiohttp nor mlx.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from mlxd.hub.pull_record import PullRecord

if TYPE_CHECKING:
    from mlxd.supervisor.registry import ModelEntry


class RemovalError(Exception):
    """mlxd does not own the model's files, or cannot delete them; the message says what to do."""


def removal_target(entry: ModelEntry, record: PullRecord, cache: Path) -> Path:
    """The dir to delete for `entry`; RemovalError if mlxd does not own it."""
    if entry.source == "models_dir":
        return entry.path
    if entry.source != "hf_cache":
        raise RemovalError(f"{entry.id} is configured in mlxd's config ([models.{entry.id}], {entry.path}); "
                           "mlxd leaves a configured model's files alone")
    storage = entry.path.parent.parent  # models--ORG--NAME/snapshots/<commit>
    if record.find(entry.id, cache) is None:
        raise RemovalError(
            f"{entry.id} is in the Hugging Face cache ({storage}) but `mlxd pull` did not put it there, "
            f"so mlxd leaves it alone; delete it with: hf cache rm model/{entry.id}"
        )
    return storage


def tree_bytes(path: Path) -> int:
    """Bytes the files under `path` take (links not followed: each blob counts once)."""
    if path.is_symlink():
        return 0
    total = 0
    for top, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # gone meanwhile
                total += os.lstat(os.path.join(top, name)).st_size
    return total


def delete_tree(path: Path) -> None:
    """Delete a dir (or just the link, when it is one); RemovalError saying why it could not."""
    try:
        if path.is_symlink():
            path.unlink()
        else:
            shutil.rmtree(path)
    except OSError as exc:
        raise RemovalError(f"cannot remove {path}: {exc.strerror or exc}") from None


def remove_model(entry: ModelEntry, record: PullRecord, cache: Path) -> tuple[Path, int]:
    """Delete `entry`'s files (and, for a pulled repo, its lock dir and record): what went, and
    its bytes. RemovalError where mlxd does not own them."""
    target = removal_target(entry, record, cache)
    num_bytes = tree_bytes(target)
    delete_tree(target)
    if entry.source == "hf_cache":
        shutil.rmtree(cache / ".locks" / target.name, ignore_errors=True)
        record.remove(entry.id, cache)
    return target, num_bytes


class OwnedModels:
    """Where a supervisor's pulls go and what it may delete: its data dir's pull record and the
    hub cache it serves from."""

    def __init__(self, data_dir: Path, cache: Path) -> None:
        self.data_dir = data_dir
        self.cache = cache
        self.record = PullRecord(data_dir)

    def target(self, entry: ModelEntry) -> Path:
        return removal_target(entry, self.record, self.cache)

    def remove(self, entry: ModelEntry) -> tuple[Path, int]:
        return remove_model(entry, self.record, self.cache)
