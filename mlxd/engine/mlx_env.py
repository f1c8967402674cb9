"""MLX settings the engine starts with, unless the environment already sets them.

MLX reads these once, at first use, so they are set before the engine imports mlx. Each
was measured on an H200 with MLX's CUDA backend (docs/benchmarks.md, "First-seen shapes on
CUDA" and "Long prompts"); they are set on CUDA only.

cuDNN's attention stays on (MLX's default): long prompts need it (a 24,000-token prompt
prefilled in 0.27 s with it, 1.3 s without). It builds a graph per attention shape, so the
engine routes each prefill chunk itself (prefill_attention.py: only few shapes, or ones worth
a graph, reach cuDNN), and:

- `MLX_ENABLE_CACHE_THRASHING_CHECK=0`: MLX's caches of cuDNN graphs and CUDA graphs throw an
  error once they have missed twice their size over the process's life (its counter is never
  reset), which a long-lived server that meets new shapes for days would reach; a miss costs
  a graph build, which is what is wanted.
- `MLX_CUDA_SDPA_CACHE_SIZE=1024`: room for every aligned prefill chunk's graph of a long
  window beside the shapes worth a graph of their own (MLX keeps 256).
- `MLX_PTX_CACHE_DIR`: the kernels MLX compiles at run time (NVRTC, a second or more each) are
  kept under the user's cache directory instead of /tmp, so only an engine's first start on a
  machine pays for them, not the first start after every reboot.
- `MLX_MAX_OPS_PER_BUFFER=100` (CUDA only): more operations to a commit (a CUDA graph when
  those are on), fewer launches a decode step.
- `MLX_USE_CUDA_GRAPHS=0`: MLX launches each kernel itself instead of capturing every
  operation into a CUDA graph and updating and launching the graph. For the small steps of
  decoding that capture costs more host time than it saves: on an H200 a 1B model's 16-row
  decode step took 6.0 ms with graphs off against 6.5 ms on (mlx-lm's plain cache: 4.7 against
  6.0 ms), mlxd at 16 streams made 2,169 and 2,745 tok/s with them off against 1,589 on in the
  same machine's calls, and a lone 8k/24k prompt prefilled no slower (docs/benchmarks.md,
  "Fourth session"). Alternated in one call later: 2,974 and 2,818 tok/s at 16 streams off
  against 2,189 and 1,886 on, 5,605 and 5,595 at 64 against 5,108 and 4,211, and the engine's
  warm-up in 5-6 s instead of 13 ("Seventh session"). The price is the lone stream: with graphs
  on the engine decodes one stream at raw mlx-lm's speed, with them off at 0.67-0.81 of it
  ("Ninth session"); the setting is one per process, and a served engine's load is concurrent.
  `[pool] cuda_graphs = true` turns them on for every engine (the supervisor puts the variable
  in their environment: engines/pool.py, engine_env_from).
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
    wanted: dict[str, str] = {}
    if cuda:
        wanted["MLX_PTX_CACHE_DIR"] = str(kernel_cache_dir(environ, version))
        wanted["MLX_MAX_OPS_PER_BUFFER"] = "100"
        wanted["MLX_ENABLE_CACHE_THRASHING_CHECK"] = "0"
        wanted["MLX_CUDA_SDPA_CACHE_SIZE"] = "1024"
        wanted["MLX_USE_CUDA_GRAPHS"] = "0"
    return {name: value for name, value in wanted.items() if name not in environ}


SETTINGS = ("MLX_PTX_CACHE_DIR", "MLX_MAX_OPS_PER_BUFFER", "MLX_ENABLE_CACHE_THRASHING_CHECK",
            "MLX_CUDA_SDPA_CACHE_SIZE", "MLX_USE_CUDA_GRAPHS")


def given(environ: Mapping[str, str], added: Mapping[str, str]) -> dict[str, str]:
    """The settings the environment gave instead of the engine (`[pool] cuda_graphs`, a user's
    export), for the engine's log: which one an engine runs with is otherwise unseen."""
    return {name: environ[name] for name in SETTINGS if name in environ and name not in added}


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
