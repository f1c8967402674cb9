"""Where a decode step's time goes: py-spy samples the engine's threads while W streams decode.

Starts one engine (`--batch 16`), runs W long streaming replies, and records 3 s of stacks
(py-spy `--threads`, raw format) once they decode; then sums the GPU thread's samples by
where they stand: waiting for the GPU (mlx-lm's `mx.eval` / `.item()` sync), building the
step's graph (the model call), or mlxd's own work. py-spy is not a dependency: pass its
binary (`pip install --target DIR py-spy`).

  python benchmarks/profile_step.py MODEL_DIR --streams 8 --py-spy /tmp/pyspy/bin/py-spy
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fair_prefill as fp

SYNC_LINES = ("GenerationBatch._step (mlx_lm/generate.py:1434)", "generate_step (mlx_lm/generate.py:472)")


def classify(stack: list[str]) -> str:
    """Where one GPU-thread sample stands."""
    if not stack:
        return "other"
    if stack[-1] in SYNC_LINES:
        return "waiting for the GPU"
    if any("__call__ (mlx_lm/models/" in f for f in stack):
        return "building the step's graph"
    if any("mlxd/" in f for f in stack[-3:]):
        return "mlxd's own work"
    return "other"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--py-spy", required=True, help="the py-spy binary")
    p.add_argument("--seconds", type=int, default=3)
    a = p.parse_args()
    proc, sock, _ = fp.start_engine(a.model, 16, 512)
    out = Path(tempfile.mkdtemp(prefix="mlxd-prof-")) / "stacks.txt"
    try:
        body = {"prompt": "Tell me a long story.", "max_tokens": 2500, "temperature": 0,
                "logit_bias": fp.logit_bias(a.model, ascii_only=False)}
        fp.stream(sock, {**body, "max_tokens": 20}, [])  # compile the shapes first
        times: list[list[float]] = [[] for _ in range(a.streams)]
        stop = threading.Event()
        threads = [threading.Thread(target=fp.stream, args=(sock, body, times[i], stop)) for i in range(a.streams)]
        for t in threads:
            t.start()
        time.sleep(2)
        before, t0 = sum(map(len, times)), time.perf_counter()
        subprocess.run([a.py_spy, "record", "-d", str(a.seconds), "-r", "250", "-f", "raw", "-o", str(out),
                        "--pid", str(proc.pid), "--threads", "--nonblocking"], capture_output=True, check=False)
        rate = (sum(map(len, times)) - before) / (time.perf_counter() - t0)
        stop.set()
        for t in threads:
            t.join()
    finally:
        proc.terminate()
        proc.wait(30)
    shares: Counter[str] = Counter()
    for line in out.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        if "mlxd-gpu" in frames[0]:
            shares[classify(frames[1:])] += int(n)
    total = sum(shares.values())
    print(f"{a.streams} streams, {rate:.0f} text chunks/s while sampled; GPU thread, {total} samples:")
    for name, n in shares.most_common():
        print(f"  {name:28s} {n:5d}  {100 * n / max(total, 1):.0f}%")


if __name__ == "__main__":
    main()
