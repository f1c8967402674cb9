"""Slow clients against the supervisor: are they dropped on time, and do real requests notice?

Figures (issue 9):
  * 500 slow connections (a request head sent one byte every `--byte-every-s`, never finished),
    plus `--silent` connections that send nothing: every one is closed by the server within
    the head deadline plus 1 s (measured from its connect to the server's close).
  * A real request's latency during the attack within 2x of its latency without it, same run:
    `GET /v1/models` (the supervisor alone) and a short chat completion on the tiny random
    model (through an engine). Medians of `--probes` requests each, before and during.

The attack runs in a child process (its own event loop), so the probes' timing is not spent
on the attacker's CPU in this process; on a 2-core machine the two still share the cores.

  python benchmarks/slowloris.py
  python benchmarks/slowloris.py --connections 500 --head-timeout-s 10 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy_overhead import Supervisor, private_dir  # noqa: E402

HEAD = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slowloris\r\nX-Padding: aaaaaaaaaaaaaaaa\r\n"


async def slow_connection(port: int, byte_every_s: float, silent: bool, limit_s: float) -> dict[str, Any]:
    """One attacker: connect, then trickle the head (or say nothing) until the server closes."""
    started = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        return {"outcome": f"connect failed: {exc}", "held_s": 0.0}
    answer = b""
    outcome = "still open"
    try:
        async with asyncio.timeout(limit_s):
            for byte in HEAD if not silent else b"":
                writer.write(bytes([byte]))
                try:
                    answer = await asyncio.wait_for(reader.read(4096), byte_every_s)
                    break  # the server answered or closed
                except TimeoutError:
                    continue
            else:
                answer = await reader.read(4096)
            outcome = answer.split(b"\r\n", 1)[0].decode(errors="replace") if answer else "closed"
    except TimeoutError:
        outcome = "still open"
    except (ConnectionError, OSError):
        outcome = "reset"
    finally:
        writer.close()
    return {"outcome": outcome, "held_s": time.monotonic() - started}


def attack(port: int, num_slow: int, num_silent: int, byte_every_s: float, limit_s: float,
           started: Any, out: Any) -> None:
    """The child process: every attacker at once; its results on `out`."""

    async def run() -> list[dict[str, Any]]:
        tasks = [slow_connection(port, byte_every_s, False, limit_s) for _ in range(num_slow)]
        tasks += [slow_connection(port, byte_every_s, True, limit_s) for _ in range(num_silent)]
        gathered = asyncio.gather(*tasks)
        await asyncio.sleep(0.5)  # let the connects land before the probes start
        started.set()
        return await gathered

    out.put(asyncio.run(run()))


def probe(client: httpx.Client, n: int) -> dict[str, float]:
    """Median latency (ms) of `n` GET /v1/models and `n` short chat completions, interleaved."""
    models, chats = [], []
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    for _ in range(n):
        t0 = time.perf_counter()
        assert client.get("/v1/models").status_code == 200
        models.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        chats.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.05)
    return {"models_ms": statistics.median(models), "chat_ms": statistics.median(chats)}


class CpuSampler:
    """CPU seconds that some processes use from now on."""

    def __init__(self, pids: list[int]) -> None:
        import psutil

        self.procs = [psutil.Process(p) for p in pids]
        self.start = [sum(p.cpu_times()[:2]) for p in self.procs]
        self.t0 = time.perf_counter()

    def used(self) -> list[float]:
        wall = time.perf_counter() - self.t0
        return [round(sum(p.cpu_times()[:2]) - s, 2) for p, s in zip(self.procs, self.start, strict=True)] + [round(wall, 2)]


def engine_pids(pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(pid).children()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=500)
    parser.add_argument("--silent", type=int, default=10)
    parser.add_argument("--byte-every-s", type=float, default=1.0)
    parser.add_argument("--head-timeout-s", type=float, default=10.0)
    parser.add_argument("--probes", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from mlxd.engine.models.random_model import build_random_llama

    work = Path(tempfile.mkdtemp(prefix="mlxd-slowloris-"))
    model = build_random_llama(work / "tiny", context=512)
    config = work / "config.toml"
    config.write_text(f'[server]\nhead_timeout_s = {args.head_timeout_s}\n\n[models.tiny]\npath = "{model}"\n')
    sup = Supervisor(config, work / "data", private_dir(work / "rt"), work / "supervisor.log")
    try:
        sup.wait_health()
        with httpx.Client(base_url=sup.url, timeout=60) as client:
            probe(client, 3)  # start the engine, warm it up
            before = probe(client, args.probes)
            ctx = multiprocessing.get_context("spawn")
            started, out = ctx.Event(), ctx.Queue()
            limit_s = args.head_timeout_s * 3
            child = ctx.Process(target=attack, args=(sup.port, args.connections, args.silent, args.byte_every_s,
                                                     limit_s, started, out))
            child.start()
            started.wait(60)
            cpu = CpuSampler([sup.proc.pid, child.pid, *engine_pids(sup.proc.pid)])
            during = probe(client, args.probes)
            print("cpu seconds during the probes (supervisor, attacker, engines):", cpu.used())
            results = out.get(timeout=limit_s + 60)
            child.join()
            after = probe(client, 5)
    finally:
        sup.stop()
    report(args, before, during, after, results)


def report(args: argparse.Namespace, before: dict[str, float], during: dict[str, float], after: dict[str, float],
           results: list[dict[str, Any]]) -> None:
    held = sorted(r["held_s"] for r in results)
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    bound = args.head_timeout_s + 1.0
    late = sum(1 for h in held if h > bound)
    summary = {
        "connections": len(results), "outcomes": outcomes, "head_timeout_s": args.head_timeout_s,
        "held_s": {"min": round(held[0], 2), "median": round(statistics.median(held), 2), "max": round(held[-1], 2)},
        "closed_after_deadline_plus_1s": late,
        "before": before, "during": during, "after": after,
        "ratio_models": round(during["models_ms"] / before["models_ms"], 3),
        "ratio_chat": round(during["chat_ms"] / before["chat_ms"], 3),
    }
    print(json.dumps(summary, indent=2))
    print(f"\n{len(results)} slow/silent connections; closed within {bound:g} s: {len(results) - late}/{len(results)}"
          f" (max held {held[-1]:.2f} s)")
    print(f"GET /v1/models median: {before['models_ms']:.2f} ms before, {during['models_ms']:.2f} ms during "
          f"(x{summary['ratio_models']})")
    print(f"chat completion median: {before['chat_ms']:.2f} ms before, {during['chat_ms']:.2f} ms during "
          f"(x{summary['ratio_chat']})")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
