"""Where a decode step's time goes: py-spy samples the engine's threads while W streams decode.

Starts one engine (`--batch`, `auto` by default), runs W long streaming replies straight to its
socket, and once they decode records `--seconds` of stacks (py-spy `--threads`, raw format)
twice: every thread with idle ones included, then only the thread holding the GIL (`--gil`).
Prints each thread's share of the samples in both, and sums the GPU thread's samples by where
they stand: waiting for the GPU (mlx-lm's `mx.eval` / `.item()` / `.tolist()`, which release
the GIL), building the step's graph (the model call), or mlxd's own work. A thread that waits
in `mx.eval` for the GIL to come back shows there too: the GIL-only profile tells the two
apart (a thread holding the GIL is not waiting for the GPU). `--native` adds C/C++ frames.
The raw stacks go to `--keep DIR` for a closer look. py-spy is not a dependency: pass its
binary (`pip install --target DIR py-spy`).

  python benchmarks/profile_step.py MODEL_DIR --streams 16 --py-spy /tmp/pyspy/bin/py-spy --keep /tmp/prof
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fair_prefill as fp
from common import env_pairs

SYNC_CALLS = ("GenerationBatch._step (mlx_lm/generate.py", "generate_step (mlx_lm/generate.py", "_step (mlx_lm/generate.py")


def classify(stack: list[str]) -> str:
    """Where one GPU-thread sample stands (innermost Python frame last)."""
    py = [f for f in stack if "(" in f and ".py:" in f]
    if not py:
        return "other"
    if any("__call__ (mlx_lm/models/" in f for f in py):
        return "building the step's graph"
    if any(py[-1].startswith(s) for s in SYNC_CALLS):
        return "in mx.eval / .item() / .tolist()"
    if any("mlxd/" in f for f in py[-3:]):
        return "mlxd's own work"
    return "other"


def record(py_spy: str, pid: int, seconds: int, out: Path, extra: list[str]) -> None:
    """py-spy's raw stacks of every thread; it pauses the process for each sample only with
    --native (it cannot unwind native frames otherwise), which slows the engine meanwhile."""
    blocking = [] if "--native" in extra else ["--nonblocking"]
    done = subprocess.run([py_spy, "record", "-d", str(seconds), "-r", "200", "-f", "raw", "-o", str(out),
                           "--pid", str(pid), "--threads", *blocking, *extra], capture_output=True, check=False)
    if not out.exists():
        print(f"py-spy recorded nothing: {done.stderr.decode(errors='replace')[-300:]}")
        out.write_text("")


def report(path: Path, title: str) -> None:
    by_thread: Counter[str] = Counter()
    gpu: Counter[str] = Counter()
    tops: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        name = frames[0].split(" ", 2)[-1] if frames else "?"
        by_thread[name] += int(n)
        if "mlxd-gpu" in frames[0]:
            gpu[classify(frames[1:])] += int(n)
            tops[frames[-1]] += int(n)
    total = sum(by_thread.values())
    print(f"{title}: {total} samples")
    for name, n in by_thread.most_common(8):
        print(f"  thread {name[:60]:60s} {n:6d}  {100 * n / max(total, 1):.0f}%")
    g = sum(gpu.values())
    print(f"  GPU thread, {g} samples:")
    for name, n in gpu.most_common():
        print(f"    {name:34s} {n:6d}  {100 * n / max(g, 1):.0f}%")
    print("  GPU thread's innermost frames:")
    for name, n in tops.most_common(12):
        print(f"    {n:6d}  {name[:110]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--batch", default="auto")
    p.add_argument("--py-spy", required=True, help="the py-spy binary")
    p.add_argument("--seconds", type=int, default=4)
    p.add_argument("--native", action="store_true", help="C/C++ frames too (py-spy --native)")
    p.add_argument("--keep", type=Path, help="copy the raw stacks and the engine's step trace here")
    p.add_argument("--env", default="", help="NAME=VALUE[,NAME=VALUE] for the engine, e.g. MLX_USE_CUDA_GRAPHS=0")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mlxd-prof-"))
    trace = work / "steps.jsonl"
    env = env_pairs(a.env)
    proc, sock, log = fp.start_engine(a.model, a.batch, None, {"MLXD_TRACE_STEPS": str(trace), **env})
    native = ["--native"] if a.native else []
    try:
        body = {"prompt": "Tell me a long story.", "max_tokens": 3000, "temperature": 0,
                "logit_bias": fp.logit_bias(a.model, ascii_only=False)}
        fp.stream(sock, {**body, "max_tokens": 20}, [])  # compile the shapes first
        times: list[list[float]] = [[] for _ in range(a.streams)]
        stop = threading.Event()
        threads = [threading.Thread(target=fp.stream, args=(sock, body, times[i], stop)) for i in range(a.streams)]
        for t in threads:
            t.start()
        time.sleep(2)
        rates = []
        for name, extra in (("all", ["--idle", *native]), ("gil", ["--gil"])):
            before, t0 = sum(map(len, times)), time.perf_counter()
            record(a.py_spy, proc.pid, a.seconds, work / f"{name}.txt", extra)
            rates.append((sum(map(len, times)) - before) / (time.perf_counter() - t0))
        mark = time.perf_counter()
        time.sleep(1)  # an unsampled second, for the step trace
        plain = (sum(1 for ts in times for x in ts if x > mark)) / (time.perf_counter() - mark)
        stop.set()
        for t in threads:
            t.join()
    finally:
        proc.terminate()
        proc.wait(30)
    turns = [json.loads(x) for x in trace.read_text().splitlines()] if trace.exists() else []
    full = [t["ms"] for t in turns if t.get("batch") == a.streams and not t.get("prefilling")]
    if full:
        print(f"decode-only turns with {a.streams} rows: {len(full)}, median {statistics.median(full):.2f} ms, "
              f"last 100 median {statistics.median(full[-100:]):.2f} ms")
    print(f"{a.streams} streams at --batch {a.batch}{' ' + a.env if a.env else ''}: text chunks/s while sampled {rates[0]:.0f} (all threads), "
          f"{rates[1]:.0f} (GIL holder); unsampled {plain:.0f}")
    for line in log.read_text(errors="replace").splitlines():
        if "batch auto" in line or "sizing" in line:
            print("  engine:", line.split("mlxd.engine: ", 1)[-1][:300])
    report(work / "all.txt", "every thread, idle included")
    report(work / "gil.txt", "the GIL holder only")
    if a.keep:
        a.keep.mkdir(parents=True, exist_ok=True)
        for f in ("all.txt", "gil.txt", "steps.jsonl"):
            if (work / f).exists():
                shutil.copy(work / f, a.keep / f"{a.streams}_{f}")


if __name__ == "__main__":
    main()
