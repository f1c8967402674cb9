"""fp32 matmul speed on the CPU backend: mlx's bundled BLAS vs OpenBLAS preloaded.

Each case runs in a fresh process (LD_PRELOAD works only at exec), same shapes, after a
warm-up. Linux CPU (`mlx[cpu]`) only.

  python benchmarks/cpu_blas.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CASE = r"""
import time, mlx.core as mx
for m, k, n, label in [(1024, 1024, 1024, "1024x1024 @ 1024x1024"), (1, 576, 49152, "1x576 @ 576x49152 (decode lm_head)")]:
    a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
    mx.eval(a, b)
    for _ in range(3):
        mx.eval(a @ b)
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(a @ b)
    s = (time.perf_counter() - t) / reps
    print(f"  {label:38s} {s * 1e3:8.2f} ms  {2 * m * k * n / s / 1e9:7.1f} GFLOP/s")
"""


def main() -> None:
    from mlxd.engine import blas

    lib = blas.find_openblas()
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.REEXEC_MARK)}
    print("mlx's bundled BLAS:")
    subprocess.run([sys.executable, "-c", CASE], env=env, check=True)
    if lib is None:
        print("OpenBLAS not found (apt-get install libopenblas0-pthread)")
        return
    print(f"OpenBLAS preloaded ({lib}):")
    subprocess.run([sys.executable, "-c", CASE], env={**env, "LD_PRELOAD": lib}, check=True)


if __name__ == "__main__":
    main()
