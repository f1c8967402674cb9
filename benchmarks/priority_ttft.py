"""Priorities under load: an urgent request's time to first token with background streams
running, against the same on an idle engine, one supervisor at mlxd's defaults (issue 24).

Phase 1 (idle): `--samples` urgent requests (priority 0, a fresh ~200-token prompt each, 8
tokens) one after another. Phase 2 (loaded): `--background` streaming requests at priority 10
(`--background-tokens` each, enough to outlast the phase, EOS biased away) start, and once every one that runs
has its first token (those the batch has no row for wait in the engine's queue), the same
number of urgent requests go one after another. Figures: TTFT p50 of each phase and their
ratio (target at most 2x), and the rows the engine paused for the urgent ones. The background
streams are then cut off.

  python benchmarks/priority_ttft.py [--model DIR] [--background 64] [--samples 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from batching import MODEL_ID, bench_supervisor, default_model, show_log, stream_chat
from common import logit_bias

PROMPT = "Request {n}: summarise the following notes in one line. " + " ".join(f"note {i} says ok." for i in range(40))


def body(n: int, priority: int, max_tokens: int, bias: dict[str, float], stream: bool = True) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": PROMPT.format(n=n)}], "stream": stream,
            "max_tokens": max_tokens, "temperature": 0, "logit_bias": bias, "priority": priority}


async def urgent_ttfts(session: aiohttp.ClientSession, url: str, first: int, samples: int,
                       bias: dict[str, float]) -> list[float]:
    return [(await stream_chat(session, url, body(first + i, 0, 8, bias)))["ttft_s"] for i in range(samples)]


async def background_stream(session: aiohttp.ClientSession, url: str, n: int, bias: dict[str, float],
                            started: asyncio.Event, stop: asyncio.Event, max_tokens: int) -> None:
    async with session.post(f"{url}/v1/chat/completions", json=body(n, 10, max_tokens, bias)) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                started.set()
            if stop.is_set():
                return


async def engine_lanes(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/admin/engines") as resp:
        rows = (await resp.json())["data"]
    return next((r for r in rows if r["model"] == MODEL_ID), {})


async def measure(url: str, args: argparse.Namespace, bias: dict[str, float]) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await urgent_ttfts(session, url, 10_000, 2, bias)  # warm-up: the engine starts, kernels compile
        idle = await urgent_ttfts(session, url, 20_000, args.samples, bias)
        print(f"idle: urgent TTFT {[round(t * 1000) for t in idle]} ms", flush=True)
        stop = asyncio.Event()
        starts = [asyncio.Event() for _ in range(args.background)]
        tasks = [asyncio.create_task(background_stream(session, url, 30_000 + i, bias, starts[i], stop,
                                                       args.background_tokens))
                 for i in range(args.background)]
        width = int((await engine_lanes(session, url)).get("width") or args.background)
        deadline = time.monotonic() + 600
        while sum(e.is_set() for e in starts) < min(width, args.background) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        running = sum(e.is_set() for e in starts)
        print(f"{running} background streams decoding (width {width})", flush=True)
        loaded = await urgent_ttfts(session, url, 40_000, args.samples, bias)
        print(f"loaded: urgent TTFT {[round(t * 1000) for t in loaded]} ms", flush=True)
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        async with session.get(f"{url}/metrics") as resp:
            metrics = await resp.text()
    pauses = next((float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith(f'mlxd_engine_pauses_total{{model="{MODEL_ID}"}}')), 0.0)
    return {"idle_ttft_s": idle, "loaded_ttft_s": loaded, "background_running": running, "width": width,
            "pauses": pauses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path)
    p.add_argument("--background", type=int, default=64)
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--background-tokens", type=int, default=2000,
                   help="each background stream's max_tokens (what it books of the KV budget, with its prompt)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.model = args.model or default_model()
    bias = logit_bias(args.model, ascii_only=False)
    work = Path(tempfile.mkdtemp(prefix="prio-", dir="/tmp"))
    sup, _ = bench_supervisor(args.model, work)
    try:
        sup.wait_health()
        r = asyncio.run(measure(sup.url, args, bias))
    except Exception:
        show_log(work / "serve.log")
        raise
    finally:
        sup.stop()
    idle, loaded = statistics.median(r["idle_ttft_s"]), statistics.median(r["loaded_ttft_s"])
    print(f"width {r['width']}, {args.background} background streams at priority 10 ({r['background_running']} "
          f"decoding), {r['pauses']:.0f} rows paused for the urgent requests")
    print(f"urgent TTFT p50: idle {idle * 1000:.0f} ms, loaded {loaded * 1000:.0f} ms: {loaded / idle:.2f}x (target <= 2)")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **r}, indent=1))


if __name__ == "__main__":
    main()
