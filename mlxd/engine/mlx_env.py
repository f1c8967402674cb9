"""MLX settings the engine starts with, unless the environment already sets them.

MLX reads these once, at first use, so they are set before the engine imports mlx. Each
was measured on an H200 with MLX's CUDA backend (docs/benchmarks.md, "First-seen shapes on
CUDA"); on Metal and CPU only the first one is read, and it changes nothing there.

- `MLX_CUDA_USE_CUDNN_SDPA=0`: cuDNN's attention builds a graph for every new attention shape
  (prompt length, cache length, rows) and a server sees a new one with nearly every request:
  ~80 ms for each new prompt length, seconds for a first burst, stalling every running stream.
  MLX's own attention kernels build nothing per shape.
- `MLX_PTX_CACHE_DIR`: the kernels MLX compiles at run time (NVRTC, a second or more each) are
  kept under the user's cache directory instead of /tmp, so only an engine's first start on a
  machine pays for them, not the first start after every reboot.
- `MLX_MAX_OPS_PER_BUFFER=100` (CUDA only): more operations to a CUDA graph, fewer launches a
  decode step.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping
from pathlib import Path

CUDA_DISTRIBUTIONS = ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda")


def is_cuda_build() -> bool:
    """True when MLX's CUDA backend is installed (without importing mlx)."""
    for name in CUDA_DISTRIBUTIONS:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return True
    return False


def mlx_version() -> str:
    try:
        return importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def kernel_cache_dir(environ: Mapping[str, str], version: str) -> Path:
    """Where compiled kernels are kept: per MLX version, under the XDG cache directory."""
    base = Path(environ.get("XDG_CACHE_HOME") or Path(environ.get("HOME", "~")).expanduser() / ".cache")
    return base / "mlxd" / "mlx-kernels" / version


def defaults(environ: Mapping[str, str], *, cuda: bool, version: str) -> dict[str, str]:
    """The settings to add: each one the environment does not set already."""
    wanted = {"MLX_CUDA_USE_CUDNN_SDPA": "0"}
    if cuda:
        wanted["MLX_PTX_CACHE_DIR"] = str(kernel_cache_dir(environ, version))
        wanted["MLX_MAX_OPS_PER_BUFFER"] = "100"
    return {name: value for name, value in wanted.items() if name not in environ}


def cold_kernel_cache(environ: Mapping[str, str], *, cuda: bool) -> Path | None:
    """The kernel cache directory when MLX's CUDA backend will fill it from nothing (it holds no
    file yet): the engine's first start with this MLX version on this machine compiles every
    kernel it uses (about a minute on an H200), and says so."""
    path = environ.get("MLX_PTX_CACHE_DIR")
    if not cuda or not path:
        return None
    cache = Path(path)
    try:
        if cache.is_dir() and any(p.is_file() for p in cache.rglob("*")):
            return None
    except OSError:
        return None
    return cache


def apply(environ: os._Environ[str] = os.environ) -> dict[str, str]:
    """Set the defaults in this process's environment (before mlx is imported); what was set."""
    added = defaults(environ, cuda=is_cuda_build(), version=mlx_version())
    environ.update(added)
    return added
