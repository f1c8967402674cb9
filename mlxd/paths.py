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


def runtime_dir() -> Path:
    """A short private dir for Unix sockets (paths must stay under ~100 bytes)."""
    if env := os.environ.get("MLXD_RUNTIME_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if sys.platform != "darwin" and xdg and Path(xdg).is_dir():
        return Path(xdg) / "mlxd"
    return Path(f"/tmp/mlxd-{os.getuid()}")


def ensure_private_dir(path: Path) -> Path:
    """Create `path` with mode 0700, or refuse one that is not private to this user."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private_dir(path)
    return path


def check_private_dir(path: Path) -> None:
    """Raise PermissionError unless `path` is a dir owned by us with no group/other bits."""
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} is owned by uid {st.st_uid}, not {os.getuid()}")
    if st.st_mode & 0o077:
        raise PermissionError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):o}; it must be 0700 (chmod 700 {path})"
        )
