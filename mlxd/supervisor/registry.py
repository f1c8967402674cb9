"""Which models exist: config entries, mlxd's models dir and the Hugging Face hub cache."""

from __future__ import annotations

import difflib
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from mlxd import paths
from mlxd.protocol import sampling
from mlxd.protocol.capabilities import Capabilities, capabilities, template_text
from mlxd.protocol.errors import APIError
from mlxd.protocol.group import GroupSpec
from mlxd.protocol.speculation import parse_draft
from mlxd.protocol.supervisor_api import Source
from mlxd.supervisor.config import DEFAULT_BATCH, Batch, ModelConfig

NUM_LISTED_IDS = 5
RESCAN_ON_MISS_S = 1.0  # a name not found rescans the sources at most this often
MAX_SCAN_DEPTH = 3  # model dirs are flat or one level deep; bounds symlink loops


class ModelEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One model that can be served, and where it came from."""

    id: str
    path: Path
    source: Source
    size_bytes: int
    pin: bool = False
    max_context: int | None = None
    idle_ttl_s: int | None = None  # None: the pool's default
    batch: Batch = DEFAULT_BATCH  # sequences its engine decodes at once ("auto"): the entry's, else [pool] batch
    is_available: bool = True  # False: a config entry whose path is not an MLX model dir
    adapter: str | None = None  # the adapters a request that names none runs under ("none": the base)
    draft: str | None = None  # [models.NAME] draft (None: the engines' [pool] one); a draft model's, its dir
    num_draft_tokens: int | None = None
    draft_bytes: int = 0  # the draft model's size on disk (its weights load beside the model's)
    defaults: sampling.Defaults | None = None  # the config's defaults for its requests ([models.NAME.defaults] over [defaults])
    resume: bool | None = None  # [models.NAME] resume (None: [pool] resume)
    distributed: GroupSpec | None = None  # [models.NAME] distributed: served by a group of engine processes


def sampling_of(entry: ModelEntry) -> dict[str, float]:
    """What a request for this model that sets no sampling gets (its generation_config.json's
    values over mlxd's): shown in /v1/models and /admin/engines, as the engine applies them."""
    try:
        config = msgspec.json.decode((entry.path / "generation_config.json").read_bytes())
    except (OSError, msgspec.DecodeError):
        config = None
    return sampling.in_use(sampling.model_defaults(config), entry.defaults)


def _read_json(path: Path) -> Any:
    try:
        return msgspec.json.decode(path.read_bytes())
    except (OSError, msgspec.DecodeError):
        return None


def chat_template_of(entry: ModelEntry, files: set[str] | None = None) -> str | None:
    """The model's chat template (chat_template.jinja, else its tokenizer's or chat_template.json's)."""
    jinja = None
    if files is None or "chat_template.jinja" in files:
        try:
            jinja = (entry.path / "chat_template.jinja").read_text()
        except OSError:
            jinja = None
    return (template_text(_read_json(entry.path / "tokenizer_config.json"), jinja)
            or template_text(_read_json(entry.path / "chat_template.json"), None))


def capabilities_of(entry: ModelEntry) -> Capabilities:
    """What the model takes and does (protocol/capabilities.py), read from its dir."""
    try:
        files = {p.name for p in entry.path.iterdir()}
    except OSError:
        files = set()
    config = _read_json(entry.path / "config.json")
    template = chat_template_of(entry, files)
    return capabilities(config if isinstance(config, dict) else {}, files, template, entry.max_context)


def hf_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """The Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else the XDG cache."""
    if value := env.get("HF_HUB_CACHE"):
        return Path(value).expanduser()
    if value := env.get("HF_HOME"):
        return Path(value).expanduser() / "hub"
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "huggingface" / "hub"


def is_mlx_model_dir(path: Path) -> bool:
    """A dir holding config.json and at least one *.safetensors file (symlinks followed)."""
    if not (path / "config.json").is_file():
        return False
    try:
        with os.scandir(path) as it:
            return any(e.name.endswith(".safetensors") and e.is_file() for e in it)
    except OSError:
        return False


def dir_size(path: Path, depth: int = MAX_SCAN_DEPTH) -> int:
    """Total bytes of the files under `path`, following symlinks; unreadable entries count 0."""
    total = 0
    try:
        with os.scandir(path) as it:
            for entry in it:
                total += _entry_size(entry, depth)
    except OSError:
        pass
    return total


def _entry_size(entry: os.DirEntry[str], depth: int) -> int:
    """The size of one file, or of a subdir while `depth` lasts."""
    try:
        if entry.is_file():
            return entry.stat().st_size
        if entry.is_dir() and depth > 1:
            return dir_size(Path(entry.path), depth - 1)
    except OSError:  # a broken symlink (an interrupted download)
        pass
    return 0


def scan_models_dir(root: Path, batch: Batch = DEFAULT_BATCH) -> list[ModelEntry]:
    """MLX model dirs directly under mlxd's models dir; hidden dirs (imports in progress) skipped."""
    found = []
    for path in _subdirs(root):
        if not path.name.startswith(".") and is_mlx_model_dir(path):
            found.append(
                ModelEntry(
                    id=path.name, path=path, source="models_dir", size_bytes=dir_size(path), batch=batch
                )
            )
    return found


def scan_hf_cache(root: Path, batch: Batch = DEFAULT_BATCH) -> list[ModelEntry]:
    """MLX models in the hub cache, one per `models--ORG--NAME` repo with a usable snapshot."""
    found = []
    for repo in _subdirs(root):
        if not repo.name.startswith("models--"):
            continue
        snapshot = hf_snapshot(repo)
        if snapshot is not None:
            repo_id = repo.name.removeprefix("models--").replace("--", "/", 1)
            found.append(
                ModelEntry(
                    id=repo_id, path=snapshot, source="hf_cache", size_bytes=dir_size(snapshot),
                    batch=batch,
                )
            )
    return found


def hf_snapshot(repo: Path) -> Path | None:
    """The snapshot `refs/main` names if it is an MLX model dir, else the newest one that is."""
    try:
        revision = (repo / "refs" / "main").read_text().strip()
    except (OSError, UnicodeDecodeError):
        revision = ""
    if revision and is_mlx_model_dir(repo / "snapshots" / revision):
        return repo / "snapshots" / revision
    candidates = [p for p in _subdirs(repo / "snapshots") if is_mlx_model_dir(p)]
    return max(candidates, key=_mtime, default=None)


def config_entries(models: Mapping[str, ModelConfig], batch: Batch = DEFAULT_BATCH) -> list[ModelEntry]:
    """One entry per `[models.NAME]`, listed even when its path is not a model dir; `batch`: the pool's."""
    found = []
    for name, model in models.items():
        path = model.resolved_path()
        is_available = is_mlx_model_dir(path)
        found.append(
            ModelEntry(
                id=name,
                path=path,
                source="config",
                size_bytes=dir_size(path) if is_available else 0,
                pin=model.pin,
                max_context=model.max_context,
                idle_ttl_s=model.idle_ttl_s,
                batch=model.batch if model.batch is not None else batch,
                is_available=is_available,
                adapter=model.adapter,
                draft=model.draft,
                num_draft_tokens=model.num_draft_tokens,
                resume=model.resume,
                distributed=model.distributed,
            )
        )
    return found


class Registry:
    """The models that exist, rescanned on `refresh()` (stat calls only, no weights read)."""

    def __init__(
        self,
        models: Mapping[str, ModelConfig] | None = None,
        *,
        models_dir: Path | None = None,
        hf_cache: Path | None = None,
        batch: Batch = DEFAULT_BATCH,
        draft: str = "none",
        defaults: sampling.Defaults | None = None,
    ) -> None:
        self._configured = dict(models or {})
        self._defaults = defaults  # [defaults]: every model's (a config entry's own go over them)
        self._batch = batch  # [pool] batch: the width of models without their own
        self._draft = draft  # [pool] draft: a draft model named there drafts for every other model
        self._models_dir = models_dir if models_dir is not None else paths.models_dir()
        self._hf_cache = hf_cache if hf_cache is not None else hf_cache_dir()
        self._entries: dict[str, ModelEntry] = {}
        self._rescanned_at = -math.inf  # monotonic time of the last rescan for a name not found
        self.refresh()

    @property
    def models_dir(self) -> Path:
        """mlxd's own models dir (where pulls, imports and quantize jobs put models)."""
        return self._models_dir

    def refresh(self) -> None:
        """Rescan every source; config entries win over the same id elsewhere, then models_dir."""
        merged: dict[str, ModelEntry] = {}
        for entries in (
            scan_hf_cache(self._hf_cache, self._batch),
            scan_models_dir(self._models_dir, self._batch),
            config_entries(self._configured, self._batch),
        ):
            merged.update((entry.id, entry) for entry in entries)
        self._entries = dict(sorted(merged.items(), key=lambda item: _sort_key(item[0])))
        self._entries = {key: self._with_defaults(self._with_draft(entry)) for key, entry in self._entries.items()}

    def _with_defaults(self, entry: ModelEntry) -> ModelEntry:
        """`entry` with the config's request defaults: its own table's over [defaults]."""
        own = self._configured[entry.id].defaults if entry.source == "config" else None
        merged = own.over(self._defaults) if own is not None else self._defaults
        if merged is None or merged.is_empty:
            return entry
        return msgspec.structs.replace(entry, defaults=merged)

    def _with_draft(self, entry: ModelEntry) -> ModelEntry:
        """`entry` with its draft model's name resolved to its dir (by the names requests use, else
        as a path), and its size; a model named as its own draft does not draft."""
        value = entry.draft if entry.draft is not None else self._draft
        kind, _, name = parse_draft(value)
        if kind != "model":
            return entry
        found = self._lookup(name)
        path = found.path if found is not None else Path(name).expanduser()
        if path == entry.path:
            return msgspec.structs.replace(entry, draft="none")
        size = found.size_bytes if found is not None else dir_size(path) if is_mlx_model_dir(path) else 0
        return msgspec.structs.replace(entry, draft=str(path), draft_bytes=size)

    def entries(self) -> list[ModelEntry]:
        """Every known model, sorted by id."""
        return list(self._entries.values())

    def get(self, model_id: str) -> ModelEntry | None:
        """The entry with exactly this id, if any."""
        return self._entries.get(model_id)

    def resolve(self, model: str | None, loaded: Sequence[str] = ()) -> ModelEntry:
        """The entry a request's `model` field names, or an APIError (400/404) saying why not."""
        entry = self._lookup(model) if model else self._default(loaded)
        if entry is None and model and time.monotonic() - self._rescanned_at >= RESCAN_ON_MISS_S:
            # Pulled or imported since the last scan (`mlxd pull` then `mlxd run`); at most once
            # a second, so a stream of unknown names cannot keep the loop busy scanning.
            self._rescanned_at = time.monotonic()
            self.refresh()
            entry = self._lookup(model)
        if entry is None:
            raise self._not_found(model or "")
        if not entry.is_available:
            raise APIError(
                400,
                f"model '{entry.id}' is configured at {entry.path}, which is not an MLX model dir",
                param="model",
                code="model_unavailable",
            )
        return entry

    def _lookup(self, model: str) -> ModelEntry | None:
        """Exact id, else a case-insensitive id, else a unique repo name without its org."""
        if (entry := self._entries.get(model)) is not None:
            return entry
        folded = model.casefold()
        same = [e for e in self._entries.values() if e.id.casefold() == folded]
        if same:
            return min(same, key=_source_rank)
        short = [e for e in self._entries.values() if e.id.rpartition("/")[2].casefold() == folded]
        return short[0] if len(short) == 1 else None

    def _default(self, loaded: Sequence[str]) -> ModelEntry:
        """The model a request without `model` gets: the only configured, loaded or known one."""
        configured = [e for e in self._entries.values() if e.source == "config"]
        live = [self._entries[i] for i in dict.fromkeys(loaded) if i in self._entries]
        for candidates in (configured, live, list(self._entries.values())):
            if len(candidates) == 1:
                return candidates[0]
        raise APIError(
            400,
            f"Missing 'model': more than one model is available, so the request must name one. "
            f"{self._listing('')}",
            param="model",
            code="model_required",
        )

    def _not_found(self, model: str) -> APIError:
        """The 404 for an unknown model, listing a few ids that do exist."""
        return APIError(
            404,
            f"Model '{_shorten(model)}' not found. {self._listing(model)}",
            type="invalid_request_error",
            param="model",
            code="model_not_found",
        )

    def _listing(self, near: str) -> str:
        """`Available: a, b, c (and N more)`, the closest matches to `near` first."""
        ids = list(self._entries)
        if not ids:
            return (
                "No models are available: add a [models.NAME] entry to the config file, "
                "import one with `mlxd import-default`, or fetch one with `mlxd pull REPO`."
            )
        close = difflib.get_close_matches(near, ids, n=NUM_LISTED_IDS, cutoff=0.5) if near else []
        shown = list(dict.fromkeys([*close, *ids]))[:NUM_LISTED_IDS]
        more = len(ids) - len(shown)
        return f"Available: {', '.join(shown)}" + (f" (and {more} more)" if more else "")


_SOURCE_RANK: dict[str, int] = {"config": 0, "models_dir": 1, "hf_cache": 2}


def _source_rank(entry: ModelEntry) -> tuple[int, str]:
    """Config entries first, then mlxd's models dir, then the hub cache."""
    return _SOURCE_RANK[entry.source], entry.id


def _sort_key(model_id: str) -> tuple[str, str]:
    """Case-insensitive order, ties broken by the exact id."""
    return model_id.casefold(), model_id


def _shorten(text: str, limit: int = 200) -> str:
    """A client-supplied string cut to a length fit for an error message."""
    return text if len(text) <= limit else text[:limit] + "…"


def _subdirs(path: Path) -> list[Path]:
    """The dirs directly under `path` (symlinks followed); none if it is missing or unreadable."""
    try:
        with os.scandir(path) as it:
            return [Path(e.path) for e in it if _is_dir(e)]
    except OSError:
        return []


def _is_dir(entry: os.DirEntry[str]) -> bool:
    """DirEntry.is_dir without raising on a broken symlink."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def _mtime(path: Path) -> float:
    """A path's modification time, 0 if it vanished."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
