"""Where the supervisor's added time to first token goes: the TCP hop vs mlxd's request path.

A stand-in engine (tests/fake_engine.py, which answers a stream's first chunk at once) runs
under a real `mlxd serve`. The same streaming request, round after round, goes:

  direct      straight to the engine's Unix socket
  bare relay  through a bare aiohttp server on uvloop whose one handler is mlxd's `forward()`
              (what any relay on TCP costs: the hop, HTTP parsing, the upstream connect)
  supervisor  through the supervisor (that plus auth, routing, the pool, metrics)

and the figure is each one's median time to the first chunk (after 20 warm-up rounds).

  python benchmarks/ttft_hop.py [--rounds 300]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from relay_cpu import RELAY

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxd.supervisor.engines.engine import socket_path  # noqa: E402  (after the sys.path line)
from tests.support import SupervisorProcess, free_port  # noqa: E402

WARMUP = 20


async def first_chunk_s(session: aiohttp.ClientSession, url: str) -> float:
    t0 = time.perf_counter()
    first = None
    async with session.post(url, json={"model": "fake", "stream": True, "max_tokens": 2}) as resp:
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{url}: no chunk")
    return first


async def measure(urls: dict[str, str], engine_socket: str, rounds: int) -> dict[str, list[float]]:
    got: dict[str, list[float]] = {name: [] for name in urls}
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=engine_socket)) as direct, \
            aiohttp.ClientSession() as tcp:
        for i in range(WARMUP + rounds):
            names = list(urls) if i % 2 == 0 else list(reversed(urls))
            for name in names:
                took = await first_chunk_s(direct if name == "direct" else tcp, urls[name])
                if i >= WARMUP:
                    got[name].append(took)
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=300)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="mxt-", dir="/tmp") as tmp:
        work = Path(tmp)
        model = work / "fake-model"
        model.mkdir()
        (model / "config.json").write_text("{}")
        (model / "model.safetensors").write_bytes(b"")
        env = {"MLXD_ENGINE_MODULE": "tests.fake_engine", "MLXD_FAKE_MODE": "ok", "PYTHONPATH": str(ROOT)}
        sup = SupervisorProcess(f'[models.fake]\npath = "{model}"\n', work / "data", env=env).wait_up()
        relay = None
        try:
            sup.client.post("/v1/completions", json={"model": "fake", "max_tokens": 1})  # starts the engine
            engine_socket = str(socket_path(sup.runtime, "fake"))
            (work / "relay.py").write_text(RELAY.format(root=str(ROOT)))
            port = free_port()
            relay = subprocess.Popen([sys.executable, str(work / "relay.py"), engine_socket, str(port), "mlxd"])
            time.sleep(1.5)
            urls = {"direct": "http://engine/v1/completions", "bare relay": f"http://127.0.0.1:{port}/v1/completions",
                    "supervisor": f"{sup.url}/v1/completions"}
            got = asyncio.run(measure(urls, engine_socket, args.rounds))
        finally:
            if relay is not None:
                relay.terminate()
                relay.wait()
            sup.stop()
    med = {name: statistics.median(v) * 1000 for name, v in got.items()}
    print(f"time to first chunk, median of {args.rounds} rounds (stand-in engine)")
    for name, ms in med.items():
        print(f"  {name:11s} {ms:7.3f} ms   (+{ms - med['direct']:.3f} over direct)")
    print(f"  mlxd's request path over a bare relay: {med['supervisor'] - med['bare relay']:+.3f} ms")


if __name__ == "__main__":
    main()
