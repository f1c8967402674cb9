"""Pick the BLAS the engine's CPU work runs on, before mlx is imported.

The `mlx[cpu]` wheel links a reference BLAS (fp32 1024^2 matmul: ~7.5 GFLOP/s
on the test machine); preloading Debian's OpenBLAS makes it ~30x faster with
identical results. LD_PRELOAD only works at exec time, so the engine re-execs
itself once with it set.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Mapping
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
)
REEXEC_MARK = "MLXD_BLAS_REEXEC"


def is_mlx_cpu_wheel() -> bool:
    """True when the installed mlx is the Linux CPU-only wheel (`mlx[cpu]`)."""
    try:
        importlib.metadata.distribution("mlx-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def find_openblas(candidates: tuple[str, ...] = OPENBLAS_CANDIDATES) -> str | None:
    """The first OpenBLAS library present on this machine, if any."""
    return next((c for c in candidates if Path(c).exists()), None)


def preload_env(
    environ: Mapping[str, str], *, platform: str, cpu_wheel: bool, openblas: str | None
) -> dict[str, str] | None:
    """The environment to re-exec with, or None when no re-exec is wanted."""
    if platform != "linux" or not cpu_wheel or openblas is None:
        return None
    if environ.get(REEXEC_MARK) or environ.get("MLXD_BLAS", "auto") == "off":
        return None
    preload = environ.get("LD_PRELOAD", "")
    if openblas in preload.split():
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = f"{openblas} {preload}".strip()
    env[REEXEC_MARK] = "1"
    return env


def describe(environ: Mapping[str, str] = os.environ) -> str:
    """One line for the startup log saying which BLAS CPU matmuls use."""
    lib = next((p for p in environ.get("LD_PRELOAD", "").split() if "blas" in p), None)
    if lib:
        return f"BLAS: OpenBLAS preloaded ({lib})"
    if sys.platform == "linux" and is_mlx_cpu_wheel():
        return (
            "BLAS: mlx's bundled reference BLAS (slow on CPU; install libopenblas0-pthread "
            "for ~30x faster matmuls)"
        )
    return "BLAS: backend default"


def reexec_with_openblas(argv: list[str]) -> None:
    """Replace this process with one that has OpenBLAS preloaded, when that helps."""
    env = preload_env(
        os.environ, platform=sys.platform, cpu_wheel=is_mlx_cpu_wheel(), openblas=find_openblas()
    )
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *argv], env)
