"""Fair prefill: do running streams keep getting tokens while a long prompt is admitted?

One engine (`python -m mlxd.engine --batch N`, over its Unix socket) runs `--streams` long
streaming replies. The inter-token gap of those streams (time between text chunks, as a
client sees them) is measured twice in the same run:

  * quiet: for `--quiet-s` seconds with no arrival;
  * arrival: from sending one `--long-tokens`-token prompt until its first token.

Reported: p50, p99 and max of the gaps in each phase, how many gaps the running streams got
during the arrival, and the long prompt's time to first token. The batch lane prefills in
`--prefill-step`-token chunks, one per decode step; `--compare-step` runs the same again with
another chunk size (e.g. the whole prompt at once) for contrast.

  python benchmarks/fair_prefill.py                                  # SmolLM2, CPU
  python benchmarks/fair_prefill.py --model DIR --long-tokens 8000 --streams 8 --batch 16
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import random
import socket
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

from common import logit_bias  # noqa: E402


def start_engine(model: Path, batch: int | str, prefill_step: int | None,
                 env_extra: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """An engine on `model` (`--prefill-step` left at its default when None)."""
    sock_dir = Path(tempfile.mkdtemp(prefix="mx-fp-", dir="/tmp"))
    sock_dir.chmod(0o700)
    sock = sock_dir / "e.sock"
    log = sock_dir / "engine.log"
    argv = [sys.executable, "-m", "mlxd.engine", "--model", str(model), "--model-id", "m", "--socket", str(sock),
            "--batch", str(batch), *(["--prefill-step", str(prefill_step)] if prefill_step else [])]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", **(env_extra or {})}
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    wait_ready(proc, sock, log)
    return proc, sock, log


def wait_ready(proc: subprocess.Popen[bytes], sock: Path, log: Path, timeout_s: float = 300) -> None:
    """Until the engine at `sock` answers `ready` on /health (killed, and TimeoutError, if it never does)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if json.loads(request(sock, "GET", "/health").read()).get("status") == "ready":
                return
        except (OSError, ValueError, http.client.HTTPException):
            pass
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError("engine not ready")


class UnixConnection(http.client.HTTPConnection):
    """HTTP over the engine's Unix socket (the standard library only: it runs on bare GPU hosts)."""

    def __init__(self, path: Path) -> None:
        super().__init__("engine", timeout=3600)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(self._path))


def request(sock: Path, method: str, path: str, body: dict[str, Any] | None = None) -> http.client.HTTPResponse:
    conn = UnixConnection(sock)
    payload = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
    return conn.getresponse()


def stream(sock: Path, body: dict[str, Any], times: list[float], stop: threading.Event | None = None) -> None:
    """Stream a completion, noting when each text chunk arrives; leave early once `stop` is set."""
    resp = request(sock, "POST", "/v1/completions", {**body, "stream": True})
    try:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {resp.read()[:300]!r}")
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                times.append(time.perf_counter())
            if stop is not None and stop.is_set():
                return
    finally:
        resp.close()


def gaps_between(times: list[list[float]], start: float, end: float) -> list[float]:
    """Inter-chunk gaps (ms) of each stream whose later chunk falls in [start, end]."""
    out = []
    for ts in times:
        out += [(b - a) * 1000 for a, b in itertools.pairwise(ts) if start <= b <= end]
    return out


def summary(gaps: list[float]) -> dict[str, Any]:
    if not gaps:
        return {"n": 0}
    q = statistics.quantiles(gaps, n=100) if len(gaps) > 1 else [gaps[0]] * 99
    return {"n": len(gaps), "p50_ms": round(statistics.median(gaps), 2), "p99_ms": round(q[98], 2),
            "max_ms": round(max(gaps), 2)}


def run(model: Path, args: argparse.Namespace, prefill_step: int) -> dict[str, Any]:
    proc, sock, _log = start_engine(model, args.batch, prefill_step)
    try:
        bias = logit_bias(model, ascii_only=False)
        rng = random.Random(0)
        vocab = int(json.loads((model / "config.json").read_text()).get("vocab_size", 20000))
        long_prompt = [rng.randrange(100, min(vocab, 20000)) for _ in range(args.long_tokens)]
        # Warm-up: the long prompt's shapes and a decode step (kernels compile on first use on GPU).
        request(sock, "POST", "/v1/completions", {"prompt": long_prompt[: args.long_tokens // 2], "max_tokens": 2}).read()
        stop = threading.Event()
        times: list[list[float]] = [[] for _ in range(args.streams)]
        body = {"prompt": "Tell me a long story.", "max_tokens": args.max_tokens, "temperature": 0, "logit_bias": bias}
        threads = [threading.Thread(target=stream, args=(sock, body, times[i], stop)) for i in range(args.streams)]
        for t in threads:
            t.start()
        while any(len(ts) < 5 for ts in times):
            time.sleep(0.01)
        quiet_start = time.perf_counter()
        time.sleep(args.quiet_s)
        quiet_end = sent = time.perf_counter()
        long_times: list[float] = []
        stream(sock, {"prompt": long_prompt, "max_tokens": 2, "temperature": 0}, long_times)
        first = long_times[0] if long_times else time.perf_counter()
        stop.set()
        for t in threads:
            t.join()
        during = gaps_between(times, sent, first)
        return {
            "prefill_step": prefill_step,
            "quiet": summary(gaps_between(times, quiet_start, quiet_end)),
            "arrival": summary(during),
            "long_prompt_ttft_ms": round((first - sent) * 1000, 1),
        }
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="MLX model dir (default: SmolLM2, imported)")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prefill-step", type=int, default=512)
    p.add_argument("--compare-step", type=int, default=None, help="a second run with this chunk size")
    p.add_argument("--long-tokens", type=int, default=7800)
    p.add_argument("--max-tokens", type=int, default=4000, help="the running streams' replies (must outlast the arrival)")
    p.add_argument("--quiet-s", type=float, default=3.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    model = args.model
    if model is None:
        from swap import smollm2_dir

        model = smollm2_dir(Path(tempfile.mkdtemp(prefix="mlxd-fp-")))
    results = [run(model, args, args.prefill_step)]
    if args.compare_step:
        results.append(run(model, args, args.compare_step))
    out = {"model": str(model), "streams": args.streams, "batch": args.batch, "long_tokens": args.long_tokens,
           "runs": results}
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
