"""The serial lane's chunked prefill: a lone stream's TTFT, and how long a job that arrives
during that prefill waits before a lane takes it.

One engine per source tree (`python -m mlxd.engine` with PYTHONPATH at the tree, over its
Unix socket, `--batch 4`, no prompt cache), both up at once and measured in alternating turns
(the order flips each round) so that both see the same machine. Each round, on each engine:

  * ttft: a lone streamed completion of a fresh `--prompt-tokens`-token prompt (max_tokens 2):
    the time from sending it to its first text;
  * taken: the same with a new prompt, and `--delay-ms` after it a short request (16 tokens,
    max_tokens 1); its `queue_ms` (X-MLXD-Usage: submitted -> a lane took it) says how long it
    waited in the inbox and queue. Before chunking, the serial lane's whole prefill ran in one
    step, and the short job waited for all of it; now it waits for one chunk at most. Once the
    short job is answered the long stream is closed (it is cancelled at its next chunk): the
    rest of its prefill would measure nothing.

Every prompt is new (random ids from one seed), so nothing comes from a prompt cache.

  git worktree add /tmp/base ee5c246
  python benchmarks/serial_prefill.py --tree /tmp/base --tree . --rounds 5
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fair_prefill import request, stream, wait_ready  # noqa: E402

USAGE_HEADER = "X-MLXD-Usage"


def start_engine(tree: Path, model: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], Path]:
    """An engine running `tree`'s code; ready when this returns."""
    sock_dir = Path(tempfile.mkdtemp(prefix="mx-sp-", dir="/tmp"))
    sock_dir.chmod(0o700)
    sock, log = sock_dir / "e.sock", sock_dir / "engine.log"
    argv = [sys.executable, "-m", "mlxd.engine", "--model", str(model), "--model-id", "m", "--socket", str(sock),
            "--batch", str(args.batch), "--prefill-step", str(args.prefill_step), "--prompt-cache-bytes", "0",
            "--ssd-cache-bytes", "0", "--gather-ms", "0"]  # no burst gathering: a lone TTFT is a lone TTFT
    # Keep-alive comments every 0.5 s: a stream the script leaves notices it at the next one.
    env = {**os.environ, "PYTHONPATH": str(tree), "MLXD_STREAM_KEEPALIVE_S": "0.5"}
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=tree)
    wait_ready(proc, sock, log)
    return proc, sock


def ttft_ms(sock: Path, prompt: list[int], stop: threading.Event | None = None) -> float:
    times: list[float] = []
    sent = time.perf_counter()
    stream(sock, {"prompt": prompt, "max_tokens": 2, "temperature": 0}, times, stop)
    return (times[0] - sent) * 1000 if times else float("nan")


def taken_ms(sock: Path, prompt: list[int], short: list[int], delay_s: float) -> float:
    """The short job's queue_ms, sent `delay_s` into the long prompt's prefill."""
    stop = threading.Event()
    long = threading.Thread(target=ttft_ms, args=(sock, prompt, stop))
    long.start()
    time.sleep(delay_s)
    resp = request(sock, "POST", "/v1/completions", {"prompt": short, "max_tokens": 1, "temperature": 0})
    usage = json.loads(resp.getheader(USAGE_HEADER) or "{}")
    resp.read()
    stop.set()  # the long stream leaves at its next line (a keep-alive comment, or its first token)
    long.join()
    wait_idle(sock)  # its cancel lands at its next chunk: not while the other engine is measured
    return float(usage["queue_ms"])


def wait_idle(sock: Path) -> None:
    while json.loads(request(sock, "GET", "/admin/stats").read())["requests"]["active"]:
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", type=Path, action="append", required=True, help="a source tree (give two)")
    p.add_argument("--model", type=Path, default=None, help="MLX model dir (default: SmolLM2, imported)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=6000)
    p.add_argument("--prefill-step", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--delay-ms", type=float, default=300.0, help="when the short job follows the long prompt")
    p.add_argument("--ttft-only", action="store_true", help="leave out the taken measurement")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    model = args.model
    if model is None:
        from swap import smollm2_dir

        model = smollm2_dir(Path(tempfile.mkdtemp(prefix="mlxd-sp-")))
    trees = [t.resolve() for t in args.tree]
    engines = [start_engine(t, model, args) for t in trees]
    rng = random.Random(0)
    fresh = lambda n: [rng.randrange(100, 20000) for _ in range(n)]  # noqa: E731
    results: dict[str, dict[str, list[float]]] = {str(t): {"ttft_ms": [], "taken_ms": []} for t in trees}
    try:
        for _, sock in engines:  # warm-up: the chunk's shapes, the first allocations
            ttft_ms(sock, fresh(args.prefill_step + 88))
        for r in range(args.rounds):
            prompts = (fresh(args.prompt_tokens), fresh(args.prompt_tokens), fresh(16))
            order = list(zip(trees, engines, strict=True))
            for tree, (_, sock) in order if r % 2 == 0 else order[::-1]:
                results[str(tree)]["ttft_ms"].append(round(ttft_ms(sock, prompts[0]), 1))
                if not args.ttft_only:
                    taken = taken_ms(sock, prompts[1], prompts[2], args.delay_ms / 1000)
                    results[str(tree)]["taken_ms"].append(round(taken, 1))
            print(f"round {r + 1}: {json.dumps(results)}", file=sys.stderr)
    finally:
        for proc, _ in engines:
            proc.terminate()
            proc.wait(30)
    out: dict[str, Any] = {"model": str(model), "prompt_tokens": args.prompt_tokens, "prefill_step": args.prefill_step,
                           "rounds": args.rounds, "trees": {}}
    for tree, runs in results.items():
        out["trees"][tree] = {k: {"median": statistics.median(v), "runs": v} for k, v in runs.items() if v}
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
