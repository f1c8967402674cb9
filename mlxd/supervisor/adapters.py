"""Which LoRA adapters exist, and which model each one is for (files only, no mlx).

An adapter is an mlx-lm adapter dir (`adapter_config.json` + `adapters.safetensors`, as
`mlx_lm.lora` and mlxd's fine-tune jobs write them), found in mlxd's adapters dir
(`DATA_DIR/adapters/NAME`), beside the models in its models dir, or registered by path through
`POST /v1/adapters`. Its id is its dir's name (or the name it was registered under). Its base
model is what its config records: mlxd's `base_model`, else mlx-lm's `model` (the `--model`
the fine-tune ran on: a repo id or a path). An adapter is for a model when that names it: the
same registry entry, the same dir, or the same repo name without its org; one that records no
base is offered to every model (the engine checks its shapes when it loads it).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from mlxd.protocol.errors import APIError
from mlxd.supervisor.registry import ModelEntry, Registry, dir_size

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
NO_ADAPTER = "none"
RESCAN_ON_MISS_S = 1.0


class AdapterEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One adapter that can be served."""

    id: str
    path: Path
    base_model: str | None  # as its config records it (None: it does not say)
    kind: str = "lora"
    rank: int = 0
    scale: float = 0.0
    num_layers: int | None = None
    size_bytes: int = 0
    source: str = "adapters_dir"  # | "models_dir" | "registered"


def read_entry(path: Path, adapter_id: str, source: str) -> AdapterEntry | None:
    """The adapter at `path`, or None if it is not an mlx-lm adapter dir."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not (path / WEIGHTS_FILE).is_file():
        return None
    found = config.get("lora_parameters")
    params: dict[str, Any] = found if isinstance(found, dict) else {}
    base = config.get("base_model") or config.get("model")
    return AdapterEntry(
        id=adapter_id, path=path, base_model=str(base) if base else None,
        kind=str(config.get("fine_tune_type", "lora")), rank=_int(params.get("rank")),
        scale=float(params.get("scale") or 0.0), num_layers=_int(config.get("num_layers")) or None,
        size_bytes=dir_size(path), source=source,
    )


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def bare_name(name: str) -> str:
    """A repo id or path without its org or parent dirs, case-folded: `org/Model-1B` -> `model-1b`."""
    return name.rstrip("/").rpartition("/")[2].casefold()


def is_for(adapter: AdapterEntry, model: ModelEntry, registry: Registry | None = None) -> bool:
    """Whether `adapter` was made for `model` (see the module doc)."""
    base = adapter.base_model
    if base is None:
        return True
    if base == model.id or bare_name(base) in (bare_name(model.id), bare_name(str(model.path))):
        return True
    try:
        if Path(base).expanduser().resolve() == model.path.resolve():
            return True
    except OSError:
        pass
    if registry is not None:
        found = registry.get(base)
        return found is not None and found.id == model.id
    return False


class AdapterCatalog:
    """The adapters that exist, rescanned on `refresh()` (stat and a small JSON read each)."""

    def __init__(self, adapters_dir: Path | None, models_dir: Path | None = None) -> None:
        self.adapters_dir = adapters_dir
        self._models_dir = models_dir
        self._registered: dict[str, AdapterEntry] = {}
        self._entries: dict[str, AdapterEntry] = {}
        self._rescanned_at = 0.0
        self.refresh()

    def refresh(self) -> None:
        merged: dict[str, AdapterEntry] = {}
        for root, source in ((self._models_dir, "models_dir"), (self.adapters_dir, "adapters_dir")):
            for path in _subdirs(root):
                if not path.name.startswith(".") and (entry := read_entry(path, path.name, source)) is not None:
                    merged[entry.id] = entry
        merged.update(self._registered)
        self._entries = dict(sorted(merged.items(), key=lambda kv: kv[0].casefold()))

    def entries(self) -> list[AdapterEntry]:
        return list(self._entries.values())

    def get(self, adapter_id: str) -> AdapterEntry | None:
        entry = self._entries.get(adapter_id)
        if entry is None and time.monotonic() - self._rescanned_at >= RESCAN_ON_MISS_S:
            self._rescanned_at = time.monotonic()  # made since the last scan (a fine-tune finished)
            self.refresh()
            entry = self._entries.get(adapter_id)
        return entry

    def find(self, adapter_id: str) -> AdapterEntry | None:
        """`get`, rescanning on a miss whatever the last scan's age: for the admin routes that
        act on an adapter a user may have put in the dir a moment ago (a push, a fuse)."""
        if (entry := self._entries.get(adapter_id)) is None:
            self.refresh()
            entry = self._entries.get(adapter_id)
        return entry

    def register(self, path: Path, adapter_id: str | None = None) -> AdapterEntry:
        """Serve the adapter dir at `path` under `adapter_id` (its dir's name by default) until
        the supervisor stops; a 400 when it is not an adapter dir or the id is taken by another."""
        path = path.expanduser()
        adapter_id = adapter_id or path.name
        check_id(adapter_id)
        entry = read_entry(path, adapter_id, "registered")
        if entry is None:
            raise APIError(400, f"{path} is not an adapter dir (it needs {CONFIG_FILE} and {WEIGHTS_FILE}).",
                           param="path", code="adapter_invalid")
        known = self._entries.get(adapter_id)
        if known is not None and known.path.resolve() != path.resolve():
            raise APIError(400, f"Adapter id '{adapter_id}' is already {known.path}; choose another id.",
                           param="id", code="adapter_exists")
        self._registered[adapter_id] = entry
        self.refresh()
        return entry

    def for_model(self, model: ModelEntry, registry: Registry | None = None) -> list[AdapterEntry]:
        return [a for a in self._entries.values() if is_for(a, model, registry)]

    def stack(self, spec: str, model: ModelEntry, registry: Registry | None = None) -> tuple[AdapterEntry, ...]:
        """The adapters `spec` names ("id", "a+b"; "none" or "" for none), each checked to be
        for `model`: a 400 naming an unknown one or one made for another model."""
        ids = [] if spec.strip() in ("", NO_ADAPTER) else [part.strip() for part in spec.split("+")]
        stack = []
        for adapter_id in dict.fromkeys(ids):
            entry = self.get(adapter_id)
            if entry is None:
                near = ", ".join(a.id for a in self.for_model(model, registry)[:5]) or "none"
                raise APIError(400, f"Adapter '{adapter_id[:200]}' not found. Adapters for {model.id}: {near}.",
                               param="adapter", code="adapter_not_found")
            if not is_for(entry, model, registry):
                raise APIError(400, f"Adapter '{adapter_id}' is for {entry.base_model}, not {model.id}.",
                               param="adapter", code="adapter_base_mismatch")
            stack.append(entry)
        return tuple(sorted(stack, key=lambda a: a.id))


def check_id(adapter_id: str) -> None:
    if not adapter_id or len(adapter_id) > 200 or any(c in adapter_id for c in "+/: \t\n") or adapter_id == NO_ADAPTER:
        raise APIError(400, f"'{adapter_id[:200]}' cannot name an adapter (no '+', '/', ':' or spaces; not 'none').",
                       param="id", code="invalid_adapter_id")


def header_value(stack: Iterable[AdapterEntry]) -> str:
    """The engine's ADAPTER_HEADER for a stack."""
    return "+".join(a.id for a in stack) or NO_ADAPTER


def _subdirs(root: Path | None) -> list[Path]:
    if root is None:
        return []
    try:
        with os.scandir(root) as it:
            return [Path(e.path) for e in it if e.is_dir()]
    except OSError:
        return []
