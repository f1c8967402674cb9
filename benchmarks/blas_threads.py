"""Decode speed of engines side by side on the CPU, with OpenBLAS's default threads and with one.

Why make test gives each engine one OpenBLAS thread: two engines whose BLAS threads spin on
each other while the machine is busy decode many times slower than with one thread each.

    python benchmarks/blas_threads.py MODEL_DIR [--engines 2] [--tokens 48]

Run it beside a busy loop on every core (e.g. `stress-ng --cpu 2`) and without. Each engine
answers one warm-up request, then one timed greedy completion; the figure is its tokens/s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support import running_engine


def one(model: Path, tokens: int) -> float:
    """This process's engine's decode speed (tokens/s) on a short greedy completion."""
    with running_engine(model, "m", "--batch", "1") as engine:
        transport = httpx.HTTPTransport(uds=str(engine.socket))
        with httpx.Client(transport=transport, base_url="http://engine", timeout=600) as client:
            body = {"prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0, "logit_bias": {"2": -100}}
            client.post("/v1/completions", json=body)
            started = time.perf_counter()
            client.post("/v1/completions", json={**body, "prompt": "A long time ago"})
            return tokens / (time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: measure and print
    a = p.parse_args()
    if a.one:
        print(f"{one(a.model, a.tokens):.1f}")
        return
    for threads in (None, "1"):
        env = dict(os.environ)
        env.pop("OPENBLAS_NUM_THREADS", None)
        if threads:
            env["OPENBLAS_NUM_THREADS"] = threads
        argv = [sys.executable, __file__, str(a.model), "--tokens", str(a.tokens), "--one"]
        children = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True) for _ in range(a.engines)]
        speeds = [c.communicate()[0].strip() for c in children]
        print(f"OpenBLAS threads {threads or 'default'}: {a.engines} engines at once, tokens/s {', '.join(speeds)}")


if __name__ == "__main__":
    main()
