"""`mlxd pull`: an MLX model repo from the Hugging Face hub into the hub cache mlxd scans.

Files come one at a time through `hf_hub_download`, pinned to the commit the revision names
when the pull starts: a branch that moves mid-pull cannot mix two commits, and a file already
cached costs no request. `config.json` comes first, so a repo mlx-lm cannot load is refused
before its weights.

Weights (and any file of 8 MiB or more) come down through `PartialDownload` instead:
huggingface_hub 2.x writes each file to a temp file unique to the process and deletes it when the
run gives up, so an interrupted pull would start the file over. `PartialDownload` appends to
`blobs/<etag>.mlxd-partial`, a name the next run finds, with Range requests, checks the size and
sha256, and renames it to `blobs/<etag>`; `hf_hub_download` then only links it into the snapshot.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import io
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import httpx2
import msgspec
from huggingface_hub import (
    HfApi,
    constants,
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    try_to_load_from_cache,
)
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import (
    tqdm,
    validate_repo_id,
)

from mlxd.hub.partial_download import (
    PartialDownload,
    PullError,
    download_headers,
    exclusive,
)
from mlxd.hub.pull_record import PullRecord
from mlxd.supervisor.registry import is_mlx_model_dir, scan_hf_cache

# What mlx-lm's loader reads (its DEFAULT_ALLOW_PATTERNS less `*.py`: mlxd runs no repo code).
# Top-level files only: subdirs hold other formats (onnx/, original/, gguf/).
ALLOW_PATTERNS = (
    "*.json", "model*.safetensors", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt", "*.jsonl",
    "*.jinja",
)
WEIGHT_PATTERN = "model*.safetensors"
DEFAULT_REVISION = "main"
COMMIT_RE = re.compile(r"[0-9a-f]{40}")
RESUMABLE_MIN_BYTES = 8 * 1024 * 1024
FINAL_STATUSES = (401, 403, 404)  # no access, or gone: trying again will not help


class PullInterrupted(Exception):
    """Ctrl-C stopped a pull in the middle of a file it can resume; `str()` says how to go on."""


class RemoteFile(msgspec.Struct, frozen=True):
    """One file of the repo at the pulled commit."""

    name: str
    size: int | None


class PullResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a pull left in the cache, and the id mlxd serves it under (None: it does not list it)."""

    repo: str
    revision: str
    commit: str
    snapshot: Path
    model_id: str | None
    is_served_snapshot: bool  # False: the registry serves another snapshot of the repo (refs/main's)
    num_fetched_bytes: int = 0
    is_offline: bool = False


class PullEvents(Protocol):
    """What a pull reports as it goes."""

    def started(self, repo: str, revision: str, commit: str, files: list[RemoteFile]) -> None: ...
    def fetching(self, file: RemoteFile, is_cached: bool) -> None: ...
    def resuming(self, file: RemoteFile, num_fetched: int, why: str | None) -> None: ...
    def fetched(self, file: RemoteFile) -> None: ...
    def warn(self, text: str) -> None: ...


def parse_spec(spec: str) -> tuple[str, str]:
    """`ORG/NAME[@REVISION]` as (repo, revision); PullError if it is not a repo id."""
    repo, sep, revision = spec.strip().partition("@")
    if sep and not revision:
        raise PullError(f"'{spec}': nothing after '@' (write REPO@REVISION, e.g. {repo}@main)")
    try:
        validate_repo_id(repo)
    except HFValidationError:
        raise PullError(f"'{repo}' is not a Hugging Face repo id (ORG/NAME, e.g. mlx-community/Qwen3-0.6B-4bit)") from None
    return repo, revision or DEFAULT_REVISION


def select_files(names: Iterable[tuple[str, int | None]]) -> list[RemoteFile]:
    """The repo's files a model needs: top-level config, tokenizer and safetensors files."""
    return [
        RemoteFile(name, size) for name, size in names
        if "/" not in name and any(fnmatch.fnmatch(name, p) for p in ALLOW_PATTERNS)
    ]


def is_weight_file(name: str) -> bool:
    """Whether mlx-lm loads `name` as weights."""
    return fnmatch.fnmatch(name, WEIGHT_PATTERN)


def is_resumable(file: RemoteFile) -> bool:
    """Whether `file` comes through a `PartialDownload`, which a later run resumes."""
    return is_weight_file(file.name) or (file.size or 0) >= RESUMABLE_MIN_BYTES


# --- what mlx-lm can load, read from its source (importing it would import mlx) -------


class MlxLmModels(msgspec.Struct, frozen=True):
    """The model types installed mlx-lm has a module for, and its remapping tables."""

    types: frozenset[str]
    remapping: Mapping[str, str]
    architecture_remapping: Mapping[tuple[str, str], str]


def find_mlx_lm() -> MlxLmModels | None:
    """mlx-lm's model modules and remappings, without importing it; None if it is not installed."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    types = frozenset(p.stem for p in (root / "models").glob("*.py") if not p.stem.startswith("_"))
    tables = _module_dicts(root / "utils.py", ("MODEL_REMAPPING", "MODEL_ARCHITECTURE_REMAPPING"))
    return MlxLmModels(types, tables.get("MODEL_REMAPPING", {}), tables.get("MODEL_ARCHITECTURE_REMAPPING", {}))


def _module_dicts(path: Path, names: tuple[str, ...]) -> dict[str, Any]:
    """The literal dicts assigned to `names` at the top of a module's source."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return {}
    found = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        if isinstance(target := node.targets[0], ast.Name) and target.id in names:
            found[target.id] = ast.literal_eval(node.value)
    return found


def mlx_model_type(config: Mapping[str, Any], models: MlxLmModels) -> str:
    """The mlx-lm module `config` loads with (as mlx-lm's `_get_classes` picks it); PullError if none."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise PullError("its config.json has no model_type, so mlx-lm cannot load it")
    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    remapped = next(
        (models.architecture_remapping[(model_type, a)] for a in architectures
         if (model_type, a) in models.architecture_remapping),
        models.remapping.get(model_type, model_type),
    )
    if remapped not in models.types:
        raise PullError(f"model_type '{model_type}' is not supported by the installed mlx-lm")
    return remapped


# --- one file, resumable across runs ----------------------------------------------------


# --- the pull ---------------------------------------------------------------------------


class Puller:
    """Pulls repos into one hub cache and records them for `mlxd rm`."""

    def __init__(self, cache: Path, record: PullRecord, events: PullEvents,
                 bar: Callable[[str], type[tqdm]] | None = None) -> None:
        self.cache = cache
        self.record = record
        self.events = events
        self.bar = bar or named_bar  # a file's progress bar class, by its name

    def pull(self, repo: str, revision: str = DEFAULT_REVISION) -> PullResult:
        """Download what `repo@revision` needs to run; PullError with the reason if it cannot."""
        if constants.is_offline_mode():
            return self._cached(repo, revision)
        commit, files = self._list(repo, revision)
        names = {f.name for f in files}
        if "config.json" not in names:
            raise PullError(f"{repo} is not an MLX/transformers model: no config.json")
        self.events.started(repo, revision, commit, files)
        config_file = next(f for f in files if f.name == "config.json")
        is_new = not self._storage(repo).exists()
        fetched = self._fetch_counted(repo, commit, config_file)
        try:
            self._check_config(repo, self._snapshot(repo, commit) / config_file.name)
        except PullError:
            if is_new:  # leave no config-only repo behind in the shared cache
                shutil.rmtree(self._storage(repo), ignore_errors=True)
            raise
        if not any(is_weight_file(n) for n in names):
            self.events.warn(f"{repo} has no {WEIGHT_PATTERN} weights: mlx-lm cannot load it as it is")
        self.record.add(repo, self.cache, revision, commit)
        fetched += sum(self._fetch_counted(repo, commit, f) for f in files if f is not config_file)
        self._write_ref(repo, revision, commit)
        return self._result(repo, revision, commit, num_fetched_bytes=fetched)

    def _list(self, repo: str, revision: str) -> tuple[str, list[RemoteFile]]:
        """The commit `revision` names now and the files to fetch from it."""
        try:
            info = HfApi().model_info(repo, revision=revision, files_metadata=True)
        except Exception as exc:  # each kind is named by describe_hub_error
            raise PullError(describe_hub_error(exc, repo, revision)) from None
        if not info.sha:
            raise PullError(f"{constants.ENDPOINT} did not say which commit {repo}@{revision} is")
        files = select_files((s.rfilename, s.size) for s in info.siblings or ())
        return info.sha, sorted(files, key=lambda f: (is_weight_file(f.name), f.name))  # weights last

    def _check_config(self, repo: str, path: Path) -> None:
        """Refuse a config mlx-lm cannot load; warn if mlx-lm is not here to ask."""
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise PullError(f"{repo}: config.json is not JSON ({exc})") from None
        if not isinstance(config, dict):
            raise PullError(f"{repo}: config.json is not a JSON object")
        models = find_mlx_lm()
        if models is None:
            self.events.warn("mlx-lm is not installed here: cannot check that it supports this model")
            return
        try:
            mlx_model_type(config, models)
        except PullError as exc:
            raise PullError(f"{repo} cannot be served: {exc}") from None

    def _fetch_counted(self, repo: str, commit: str, file: RemoteFile) -> int:
        """Fetch one file; the bytes it cost this run (0 when cached)."""
        is_cached = self._is_cached(repo, commit, file.name)
        return self._fetch(repo, commit, file, is_cached)

    def _fetch(self, repo: str, commit: str, file: RemoteFile, is_cached: bool) -> int:
        """One file into the cache; the bytes fetched."""
        self.events.fetching(file, is_cached)
        num_bytes = 0 if is_cached else file.size or 0
        try:
            if not is_cached and is_resumable(file):
                num_bytes = self._fetch_blob(repo, commit, file)
            # A blob already there is only linked into the snapshot (after one HEAD).
            hf_hub_download(repo, file.name, revision=commit, cache_dir=self.cache, tqdm_class=self.bar(file.name))
        except HfHubHTTPError as exc:
            if _status(exc) in FINAL_STATUSES:
                raise PullError(describe_hub_error(exc, repo, commit)) from None
            raise PullError(_stopped(repo, file, exc)) from None
        except (OSError, httpx2.HTTPError) as exc:
            raise PullError(_stopped(repo, file, exc)) from None
        self.events.fetched(file)
        return num_bytes

    def _fetch_blob(self, repo: str, commit: str, file: RemoteFile) -> int:
        """Fetch `file` into its blob as a `PartialDownload` a later run resumes; the bytes this run fetched."""
        url = hf_hub_url(repo, file.name, revision=commit)
        meta = get_hf_file_metadata(url)  # the final location: the hub sends LFS files to a CDN
        size = meta.size if meta.size is not None else file.size
        if meta.etag is None or size is None:
            return file.size or 0  # nothing to resume against: hf_hub_download fetches it whole
        download = PartialDownload(file.name, self._storage(repo) / "blobs" / meta.etag, meta.location,
                                   download_headers(url, meta.location), size)
        lock = self.cache / ".locks" / self._storage(repo).name / (download.partial.name + ".lock")
        with exclusive(lock, lambda: self.events.warn(f"another mlxd pull is fetching {file.name}; waiting for it")):
            if download.blob.exists():  # the other pull finished it
                return 0
            if download.num_fetched():
                self.events.resuming(file, download.num_fetched(), None)
            self._run_download(repo, file, download)
        return download.num_new_bytes

    def _run_download(self, repo: str, file: RemoteFile, download: PartialDownload) -> None:
        """`download.run()`, its failures told with how much is kept for the next run."""
        def on_retry(exc: BaseException) -> None:
            self.events.resuming(file, download.num_fetched(), _reason(exc))

        try:
            download.run(self.bar(file.name), on_retry)
        except KeyboardInterrupt:
            raise PullInterrupted(_resume_hint(download)) from None
        except (OSError, httpx2.HTTPError) as exc:
            # Even a 403: the HEAD just now had access, and a CDN's signed URL expires; the next run gets a new one.
            raise PullError(_stopped(repo, file, exc, _resume_hint(download))) from None

    def _is_cached(self, repo: str, commit: str, name: str) -> bool:
        return isinstance(try_to_load_from_cache(repo, name, cache_dir=self.cache, revision=commit), str)

    def _write_ref(self, repo: str, revision: str, commit: str) -> None:
        """`refs/<revision>` names the commit, as huggingface_hub's own snapshot_download leaves it."""
        if revision == commit:
            return
        ref = self._storage(repo) / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}")
        tmp.write_text(commit)
        os.replace(tmp, ref)

    def _cached(self, repo: str, revision: str) -> PullResult:
        """Offline: the repo as the cache already holds it, or PullError."""
        commit = revision if COMMIT_RE.fullmatch(revision) else _read_ref(self._storage(repo), revision)
        if commit is None or not is_mlx_model_dir(self._snapshot(repo, commit)):
            raise PullError(
                f"HF_HUB_OFFLINE is set and {repo}@{revision} is not in the hub cache ({self.cache}); "
                "unset HF_HUB_OFFLINE to download it"
            )
        return self._result(repo, revision, commit, is_offline=True)

    def _result(self, repo: str, revision: str, commit: str, **extra: Any) -> PullResult:
        snapshot = self._snapshot(repo, commit)
        storage = self._storage(repo)
        entry = next((e for e in scan_hf_cache(self.cache) if e.path.parent.parent == storage), None)
        return PullResult(
            repo=repo, revision=revision, commit=commit, snapshot=snapshot,
            model_id=entry.id if entry else None, is_served_snapshot=entry is not None and entry.path == snapshot,
            **extra,
        )

    def _snapshot(self, repo: str, commit: str) -> Path:
        return self._storage(repo) / "snapshots" / commit

    def _storage(self, repo: str) -> Path:
        return self.cache / ("models--" + repo.replace("/", "--"))


def named_bar(name: str) -> type[tqdm]:
    """huggingface_hub's progress bar, labelled with the file's name (it would show the URL's tail)."""

    class NamedBar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "desc": name})

    return NamedBar


def counting_bar(on_bytes: Callable[[str, int], None]) -> Callable[[str], type[tqdm]]:
    """Progress bars that draw nothing and tell `on_bytes(file name, bytes)` of each step (a
    server's pull reports its progress so)."""
    def bar(name: str) -> type[tqdm]:
        class CountingBar(tqdm):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **{**kwargs, "desc": name, "file": io.StringIO()})

            def update(self, n: float | None = 1) -> bool | None:
                on_bytes(name, int(n or 0))
                return super().update(n)

        return CountingBar

    return bar


def _read_ref(storage: Path, revision: str) -> str | None:
    try:
        return (storage / "refs" / revision).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def describe_hub_error(exc: BaseException, repo: str, revision: str) -> str:
    """One line for a failed hub call: what went wrong and what to do about it."""
    endpoint = constants.ENDPOINT
    if isinstance(exc, RevisionNotFoundError):
        return f"{repo} has no revision '{revision}' on {endpoint}"
    if isinstance(exc, GatedRepoError):
        return (f"{repo} is gated: accept its terms on {endpoint}/{repo}, "
                "then set HF_TOKEN to a token of that account")
    if isinstance(exc, RepositoryNotFoundError):
        token = " (or HF_TOKEN has no access to it)" if os.environ.get("HF_TOKEN") else " (or it is private: set HF_TOKEN)"
        return f"{repo} not found on {endpoint}{token}"
    if isinstance(exc, RemoteEntryNotFoundError):
        return f"{repo}@{revision}: a file it lists is not there ({_reason(exc)})"
    if isinstance(exc, HfHubHTTPError) and (status := _status(exc)) is not None:
        if status == 401:
            return f"{endpoint} refused HF_TOKEN (401): set HF_TOKEN to a valid token, or unset it"
        return f"{endpoint} answered {status} for {repo}@{revision}"
    if isinstance(exc, OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set"
    if isinstance(exc, httpx2.HTTPError | OSError):
        return f"cannot reach {endpoint}: {_reason(exc)}"
    return f"{repo}@{revision}: {type(exc).__name__}: {_reason(exc)}"


def _stopped(repo: str, file: RemoteFile, exc: BaseException,
             hint: str = "run the same command again to go on (the files already fetched are kept)") -> str:
    return f"download of {repo} stopped at {file.name} ({_reason(exc)}); {hint}"


def _resume_hint(download: PartialDownload) -> str:
    return f"run the same command again to resume ({download.progress()})"


def _status(exc: HfHubHTTPError) -> int | None:
    return exc.response.status_code if exc.response is not None else None


def _reason(exc: BaseException) -> str:
    """The first line of an exception's text, or its type."""
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
