"""A burst split in two: time to first token when a few requests of a burst come a moment late.

Starts an engine (`python -m mlxd.engine --batch auto`, as mlxd serve starts it, no prompt
cache, over its socket),
then each round sends `--first` streamed completions at once and, `--delay-ms` later (past the
engine's gather window, inside the first ones' prefill), `--late` more; every prompt is unique.
Prints each round's time to first text for both groups (client side) and their medians over
the rounds after one warm-up round (`--late 0`: one burst of `--first`). `--repo DIR` runs the
engine from another checkout (a git worktree of an earlier commit) to compare two versions on
the same machine.

  python benchmarks/split_burst.py --model ~/.local/share/mlxd/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

try:
    import httpx2 as httpx
except ImportError:
    import httpx  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from fair_prefill import wait_ready  # noqa: E402


def start_engine(model: Path, repo: Path, work: Path) -> tuple[subprocess.Popen[bytes], Path]:
    sock, log = work / "e.sock", work / "engine.log"
    env = {**os.environ, "PYTHONPATH": str(repo), "MLXD_DATA_DIR": str(work / "data")}
    proc = subprocess.Popen([sys.executable, "-m", "mlxd.engine", "--model", str(model), "--model-id", "m",
                             "--socket", str(sock), "--prompt-cache-bytes", "0", "--batch", "auto"], cwd=repo, env=env,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    wait_ready(proc, sock, log, timeout_s=600)
    return proc, sock


def ttft(sock: Path, prompt: str, max_tokens: int, out: list[float], go: threading.Barrier, delay_s: float) -> None:
    """One streamed completion, sent `delay_s` after every client is connected; its TTFT to `out`."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    seen = False
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://e", timeout=600) as c:
        c.get("/health")  # connected before the start, so the group arrives within the gather window
        go.wait()
        time.sleep(delay_s)
        sent = time.perf_counter()
        with c.stream("POST", "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():  # to the end: the row keeps decoding
                if not seen and line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                    out.append(time.perf_counter() - sent)
                    seen = True


def round_once(sock: Path, rng: random.Random, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    words = ["river", "lamp", "stone", "cloud", "field", "glass", "rope", "seed", "hill", "moon"]

    def prompt() -> str:
        return " ".join(rng.choice(words) for _ in range(args.prompt_words))

    first: list[float] = []
    late: list[float] = []
    go = threading.Barrier(args.first + args.late)
    threads = [threading.Thread(target=ttft, args=(sock, prompt(), args.max_tokens, first, go, 0.0))
               for _ in range(args.first)]
    threads += [threading.Thread(target=ttft, args=(sock, prompt(), args.max_tokens, late, go, args.delay_ms / 1000))
                for _ in range(args.late)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return first, late


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose engine runs (default: this one)")
    p.add_argument("--first", type=int, default=5)
    p.add_argument("--late", type=int, default=3)
    p.add_argument("--delay-ms", type=float, default=150)
    p.add_argument("--prompt-words", type=int, default=150)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="split-"))
    proc, sock = start_engine(args.model.expanduser(), args.repo.resolve(), work)
    rng = random.Random(0)
    firsts: list[float] = []
    lates: list[float] = []
    try:
        for i in range(-1, args.rounds):
            first, late = round_once(sock, rng, args)
            print(f"round {i}: first {sorted(round(x, 2) for x in first)} s, late {sorted(round(x, 2) for x in late)} s",
                  flush=True)
            if i >= 0:
                firsts += first
                lates += late
    finally:
        proc.terminate()
        proc.wait(30)
    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} s" if xs else "-"

    print(f"{args.repo.resolve()}: TTFT median first {med(firsts)}, late {med(lates)}, "
          f"all {med(firsts + lates)} ({args.first}+{args.late} requests, late by {args.delay_ms:.0f} ms, "
          f"{args.rounds} rounds)")


if __name__ == "__main__":
    main()
