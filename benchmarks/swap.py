"""Model swaps with `max_loaded = 1`: what a swap costs, and what batching saves.

Figures (issue 4):
  * swap A -> B -> A (the tiny random model and SmolLM2): the time from sending a request for
    the unloaded model to its first token, split into drain and stop (the old engine), spawn
    (handing the spare engine process its model, until it answers) and load (the new engine),
    and first token (the engine's queue + prefill + first decode step, from its /admin/stats).
    The supervisor's own share is everything but load and first token (target <= 200 ms).
  * 100 requests alternating between the two models, 8 in flight at a time, vs the same
    requests sorted by model: failures (target 0), swaps performed, total time.

Each swap waits first until the supervisor's spare engine process has finished its imports
(`/admin/engines` -> spare.warm), as it has in steady use; `--no-wait-spare` measures swaps
that come faster than the spare can get ready.

  python benchmarks/swap.py
  python benchmarks/swap.py --swaps 6 --requests 100
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2 as httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy_overhead import Supervisor, private_dir  # noqa: E402

from mlxd.supervisor.engines.engine import socket_path  # noqa: E402

MODELS = ("tiny", "smol")


def smollm2_dir(work: Path) -> Path:
    """The imported default model if there is one, else a fresh import into `work`."""
    from mlxd.paths import DEFAULT_MODEL_ID, models_dir

    installed = models_dir() / DEFAULT_MODEL_ID
    if (installed / "config.json").is_file():
        return installed
    from mlxd.engine.models.importer import import_default

    return import_default(work / "models")


def engines(url: str) -> dict[str, Any]:
    body = httpx.get(f"{url}/admin/engines", timeout=30).json()
    return {e["model"]: e for e in body["data"]} | {"_": body}


def wait_spare_warm(url: str, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engines(url)["_"]["spare"]["warm"]:
            return True
        time.sleep(0.05)
    return False


CLIENT = httpx.Client(timeout=300)  # keeps its connection, as an SDK client does


def first_token_s(url: str, model: str) -> float:
    """Send a streaming request; seconds until its first content chunk."""
    body = {"model": model, "prompt": "Hello there", "max_tokens": 4, "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    first = None
    with CLIENT.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {resp.status_code}: {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{model}: no token")
    return first


def engine_first_token_ms(runtime: Path, model: str) -> float:
    """The engine's own queue + prefill time for its last request, and one decode step."""
    transport = httpx.HTTPTransport(uds=str(socket_path(runtime, model)))
    with httpx.Client(transport=transport, base_url="http://engine", timeout=30) as client:
        last = client.get("/admin/stats").json()["last"]
    t = last["timings_ms"]
    tokens = max(1, int(last["completion_tokens"] or 1))
    return float(t["queue"] + t["prefill"] + t["decode"] / tokens)


def measure_swaps(sup: Supervisor, num: int, wait_spare: bool) -> list[dict[str, float]]:
    rows = []
    order = [MODELS[i % 2] for i in range(num + 1)]
    for i, model in enumerate(order):
        if wait_spare and not wait_spare_warm(sup.url):
            raise RuntimeError("the spare engine did not get ready")
        old = MODELS[(i + 1) % 2]
        total = first_token_s(sup.url, model)
        info = engines(sup.url)
        if i == 0:
            continue  # a cold start, not a swap
        engine_ms = engine_first_token_ms(sup.runtime_dir, model)
        if wait_spare:
            wait_spare_warm(sup.url)  # so that the spare's imports don't slow the baseline
        warm = first_token_s(sup.url, model)  # baseline: the same request with no swap
        stop, boot = info[old]["last_stop"] or {}, info[model]["boot"] or {}
        row = {
            "to": model, "total_ms": total * 1000,
            "drain_ms": stop.get("drain_ms", 0.0), "stop_ms": stop.get("stop_ms", 0.0),
            "spawn_ms": boot.get("spawn_ms", 0.0), "load_ms": boot.get("load_ms", 0.0),
            "first_token_ms": engine_ms,
        }
        row["supervisor_ms"] = row["total_ms"] - row["load_ms"] - row["first_token_ms"]
        row["no_swap_total_ms"] = warm * 1000
        rows.append(row)
        print(f"  swap {i}: -> {model:5s} " + " ".join(f"{k}={v:8.1f}" for k, v in row.items() if k != "to"))
    return rows


def run_batch(url: str, order: list[str], parallel: int) -> dict[str, float]:
    before = engines(url)["_"]["evictions"]
    body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0}

    def ask(model: str) -> int:
        try:
            return httpx.post(f"{url}/v1/completions", json={**body, "model": model}, timeout=600).status_code
        except httpx.HTTPError:
            return -1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        statuses = list(pool.map(ask, order))
    wall = time.perf_counter() - t0
    return {"requests": len(order), "failures": sum(s != 200 for s in statuses),
            "swaps": engines(url)["_"]["evictions"] - before, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--swaps", type=int, default=6, help="swaps to time (A->B->A->...)")
    p.add_argument("--requests", type=int, default=100, help="requests in the alternating batch")
    p.add_argument("--parallel", type=int, default=8, help="requests in flight at once in the batch")
    p.add_argument("--no-wait-spare", action="store_true", help="do not wait for the spare engine before a swap")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    from mlxd.engine.models.random_model import build_random_llama

    with tempfile.TemporaryDirectory(prefix="mxs-", dir="/tmp") as tmp:
        work = private_dir(Path(tmp))
        tiny = build_random_llama(work / "tiny", context=4096)
        smol = smollm2_dir(work)
        config = work / "mlxd.toml"
        config.write_text(f'[pool]\nmax_loaded = 1\n\n[models.tiny]\npath = "{tiny}"\n\n[models.smol]\npath = "{smol}"\n')
        os.environ["MLXD_SPARE_ENGINE"] = "1"
        sup = Supervisor(config, private_dir(work / "data"), private_dir(work / "rt"), work / "serve.log")
        try:
            sup.wait_health()
            print(f"swaps, max_loaded = 1 (tiny random llama <-> SmolLM2 {smol.name}):")
            rows = measure_swaps(sup, args.swaps, not args.no_wait_spare)
            alternating = [MODELS[i % 2] for i in range(args.requests)]
            wait_spare_warm(sup.url)
            alt = run_batch(sup.url, alternating, args.parallel)
            wait_spare_warm(sup.url)
            srt = run_batch(sup.url, sorted(alternating), args.parallel)
        finally:
            sup.stop()
    keys = ["total_ms", "drain_ms", "stop_ms", "spawn_ms", "load_ms", "first_token_ms", "supervisor_ms",
            "no_swap_total_ms"]
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    for model in MODELS:
        mine = [r for r in rows if r["to"] == model]
        if mine:
            print(f" to {model}: " + " ".join(f"{k}={statistics.median(r[k] for r in mine):.1f}" for k in keys))
    print(" medians over swaps: " + " ".join(f"{k}={v:.1f}" for k, v in med.items()))
    print(f" {args.requests} alternating requests, {args.parallel} in flight: {alt}")
    print(f" the same sorted by model:                 {srt}")
    print(f" alternating / sorted wall time: {alt['wall_s'] / srt['wall_s']:.2f}")
    worst = max(statistics.median(r["supervisor_ms"] for r in rows if r["to"] == m) for m in MODELS)
    ok = worst <= 200 and alt["failures"] == 0
    print(f" targets: supervisor share <= 200 ms (worse direction, {worst:.0f} ms): {'met' if worst <= 200 else 'MISSED'}; "
          f"zero failures: {'met' if alt['failures'] == 0 and srt['failures'] == 0 else 'MISSED'}")
    if args.json:
        args.json.write_text(json.dumps({"swaps": rows, "medians": med, "alternating": alt, "sorted": srt}, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
