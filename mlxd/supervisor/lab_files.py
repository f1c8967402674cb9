"""The lab's files beside models and adapters: the datasets dir, and the Hugging Face token.

A dataset is a dir under `datasets/` holding what mlx-lm's tuner reads (train.jsonl,
valid.jsonl); a dataset job writes one there and a fine-tune names it by its name. The token
(`mlxd login`, `POST /lab/settings/hf-token`) is one line in `hf_token`, mode 0600, written
whole or not at all; it is read only to hand it to a push job's worker, and never answered,
logged or put in a job's files. `HF_TOKEN` in the supervisor's environment counts too, as
huggingface_hub reads it, though a saved token comes first.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Literal

import msgspec

from mlxd.paths import datasets_dir, hf_token_file
from mlxd.protocol.datasets import SPLITS, DatasetError, check_file

MAX_TOKEN_CHARS = 400


class DatasetInfo(msgspec.Struct, kw_only=True):
    name: str
    path: str
    format: str | None
    rows: dict[str, int]  # per split file
    modified_at: float


class TokenState(msgspec.Struct, kw_only=True):
    """What `GET /lab/settings/hf-token` says: whether there is a token, never the token."""

    has_token: bool
    source: Literal["file", "env"] | None = None


class LabFiles:
    """The datasets dir and the token file of one data dir (`root` None: neither exists)."""

    def __init__(self, root: Path | None) -> None:
        self.datasets_dir = datasets_dir(root) if root is not None else None
        self._token_file = hf_token_file(root) if root is not None else None

    def dataset_path(self, name: str) -> Path | None:
        """The dataset dir `name` names, if there is one."""
        if self.datasets_dir is None or "/" in name or name.startswith("."):
            return None
        path = self.datasets_dir / name
        return path if path.is_dir() else None

    def datasets(self) -> list[DatasetInfo]:
        """The datasets in the datasets dir, newest first (a dir being written is hidden)."""
        if self.datasets_dir is None or not self.datasets_dir.is_dir():
            return []
        found = []
        for path in self.datasets_dir.iterdir():
            if path.name.startswith(".") or not path.is_dir():
                continue
            rows, fmt = {}, None
            for split in SPLITS:
                if (path / f"{split}.jsonl").is_file():
                    with contextlib.suppress(DatasetError):
                        report = check_file(path / f"{split}.jsonl", split)
                        rows[split], fmt = report.rows, fmt or report.format
            found.append(DatasetInfo(name=path.name, path=str(path), format=fmt, rows=rows,
                                     modified_at=path.stat().st_mtime))
        return sorted(found, key=lambda d: -d.modified_at)

    def token(self) -> str | None:
        """The saved token, else $HF_TOKEN, else None."""
        if self._token_file is not None:
            with contextlib.suppress(OSError, UnicodeDecodeError):
                if saved := self._token_file.read_text(encoding="utf-8").strip():
                    return saved
        return os.environ.get("HF_TOKEN") or None

    def token_state(self) -> TokenState:
        if self._token_file is not None and self._token_file.is_file():
            return TokenState(has_token=True, source="file")
        return TokenState(has_token=bool(os.environ.get("HF_TOKEN")), source="env" if os.environ.get("HF_TOKEN") else None)

    def save_token(self, token: str) -> None:
        """Keep `token` (mode 0600 from the start: never readable by others, even briefly)."""
        if self._token_file is None:
            raise OSError("this supervisor has no data dir")
        write_private(self._token_file, token.strip() + "\n")

    def forget_token(self) -> bool:
        """Remove the saved token; whether there was one."""
        if self._token_file is None:
            return False
        try:
            self._token_file.unlink()
        except FileNotFoundError:
            return False
        return True


def check_token(token: object) -> str:
    """The token, stripped; ValueError saying why it cannot be one."""
    if not isinstance(token, str) or not token.strip():
        raise ValueError("`token` must be a non-empty string")
    token = token.strip()
    if len(token) > MAX_TOKEN_CHARS or any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError("`token` is not a Hugging Face token (one word of printable characters)")
    return token


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 0600: a private temp file beside it, renamed over it (a
    name of its own for each write: two saves at once each rename a whole file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    try:
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise
