"""Where mlxd keeps its files: data dir (models, caches, logs) and runtime dir (sockets)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


def data_dir() -> Path:
    """The data dir: $MLXD_DATA_DIR, else the platform's per-user data dir."""
    if env := os.environ.get("MLXD_DATA_DIR"):
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "mlxd"
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "mlxd"


def models_dir(root: Path | None = None) -> Path:
    """mlxd's own models dir, inside the data dir."""
    return (root or data_dir()) / "models"


def adapters_dir(root: Path | None = None) -> Path:
    """mlxd's own LoRA adapters dir (one adapter dir per adapter), inside the data dir."""
    return (root or data_dir()) / "adapters"


def datasets_dir(root: Path | None = None) -> Path:
    """mlxd's own fine-tune datasets (one dir each: train.jsonl, valid.jsonl), inside the data dir."""
    return (root or data_dir()) / "datasets"


def hf_token_file(root: Path | None = None) -> Path:
    """Where `mlxd login` keeps the Hugging Face token (mode 0600)."""
    return (root or data_dir()) / "hf_token"


def rank_key_file(root: Path | None = None) -> Path:
    """The key an engine group's hosts share (`mlxd rank --new-key` writes it; mode 0600)."""
    return (root or data_dir()) / "rank.key"


def runtime_dir() -> Path:
    """A short private dir for Unix sockets (paths must stay under ~100 bytes)."""
    if env := os.environ.get("MLXD_RUNTIME_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if sys.platform != "darwin" and xdg and Path(xdg).is_dir():
        return Path(xdg) / "mlxd"
    return Path(f"/tmp/mlxd-{os.getuid()}")


class PrivateDirError(PermissionError):
    """The runtime dir is not private to this user; the message says why and how to fix it."""


# What to do when the runtime dir is not ours to chmod.
_ELSEWHERE = "remove it, or set MLXD_RUNTIME_DIR to a dir of your own"


def ensure_private_dir(path: Path) -> Path:
    """Create `path` with mode 0700, or refuse one that is not private to this user."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        pass  # a file or a dangling symlink: check_private_dir names it
    except OSError as exc:
        raise PrivateDirError(f"cannot create runtime dir {path}: {exc.strerror or exc}") from None
    check_private_dir(path)
    return path


def check_private_dir(path: Path) -> None:
    """Raise PrivateDirError unless `path` is a dir (not a symlink) owned by us with no group/other bits."""
    try:
        st = path.lstat()  # lstat: a symlink could be swapped to point elsewhere
    except OSError as exc:
        raise PrivateDirError(f"runtime dir {path}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise PrivateDirError(f"runtime dir {path} is a symlink{_link_target(path)}; mlxd refuses it: {_ELSEWHERE}")
    if not stat.S_ISDIR(st.st_mode):
        raise PrivateDirError(f"runtime dir {path} is not a directory: {_ELSEWHERE}")
    if st.st_uid != os.getuid():
        raise PrivateDirError(
            f"runtime dir {path} is owned by uid {st.st_uid}, not by you (uid {os.getuid()}); "
            f"it must be 0700 and owned by you: {_ELSEWHERE}"
        )
    if st.st_mode & 0o077:
        raise PrivateDirError(
            f"runtime dir {path} is not private (mode {stat.S_IMODE(st.st_mode):o}); "
            f"it must be 0700 and owned by you: chmod 700 {shell_quote(path)}"
        )


def _link_target(path: Path) -> str:
    try:
        return f" (to {os.readlink(path)})"
    except OSError:
        return ""


def make_private_dirs(path: Path) -> Path:
    """`mkdir -p path`, each dir it creates mode 0700 (as XDG asks); dirs already there keep their mode."""
    missing = []
    each = path
    while not os.path.lexists(each) and each.parent != each:
        missing.append(each)
        each = each.parent
    for each in reversed(missing):
        try:
            each.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile by a concurrent mlxd
            if not each.is_dir():
                raise
    return path


def shell_quote(path: Path) -> str:
    """`path` as a shell word, for a command to paste (macOS paths hold spaces)."""
    import shlex  # here, not at import: only an error message needs it

    return shlex.quote(str(path))
