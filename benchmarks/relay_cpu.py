"""The relay's CPU per streamed chunk: mlxd's upstream protocol vs aiohttp's client, same run.

A stand-in engine (an aiohttp app on a Unix socket) streams `--chunks` SSE chunks of the size
the engine sends, `--gap-ms` apart. Two relay processes sit in front of it, each an aiohttp
server on uvloop as the supervisor is: `mlxd` relays with `mlxd.supervisor.relay.forward.forward`,
`aiohttp` with an aiohttp `ClientSession` over the same socket, reading `iter_any()` and writing
`StreamResponse.write()` per chunk (how mlxd relayed before). Rounds alternate between them; the
figure is each relay process's CPU time (user + system) per chunk, and the ratio. A third relay,
`marked`, is mlxd's with resume on (docs/resume.md): the stand-in engine then ends each chunk
with a resume mark, which the relay strips and keeps.

  python benchmarks/relay_cpu.py                  # 6 rounds x 2000 chunks, 1 ms apart
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
CHUNK = (b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","created":1795963598,"model":"bench",'
         b'"choices":[{"index":0,"text":" word","finish_reason":null,"logprobs":null}],"usage":null,'
         b'"object":"text_completion"}\n\n')

ENGINE = """
import asyncio, sys
from aiohttp import web
N, GAP = int(sys.argv[2]), float(sys.argv[3])
CHUNK = {chunk!r}
async def stream(request):
    await request.read()
    resp = web.StreamResponse(headers={{"Content-Type": "text/event-stream"}})
    await resp.prepare(request)
    marked = "X-MLXD-Marks" in request.headers
    for i in range(N):
        await resp.write(CHUNK + b": ids 0 %d 1234\\n\\n" % (i + 1) if marked else CHUNK)
        await asyncio.sleep(GAP)
    await resp.write(b"data: [DONE]\\n\\n")
    await resp.write_eof()
    return resp
app = web.Application()
app.router.add_post("/v1/completions", stream)
web.run_app(app, path=sys.argv[1], print=None)
"""

RELAY = """
import sys
import aiohttp, uvloop
from aiohttp import web
sys.path.insert(0, {root!r})
from mlxd.supervisor.engines.upstream import connection_gate
from mlxd.supervisor.relay.dialects import OPENAI
from mlxd.supervisor.relay.forward import forward
from mlxd.supervisor.relay.resume import ReplyMarks
GATE = connection_gate()
SOCK, PORT, MODE = sys.argv[1], int(sys.argv[2]), sys.argv[3]
async def session(app):
    app["session"] = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=SOCK))
    yield
    await app["session"].close()
async def relay(request):
    body = await request.read()
    if MODE == "mlxd":
        return await forward(request, SOCK, GATE, body, {{}}, OPENAI)
    if MODE == "marked":
        return await forward(request, SOCK, GATE, body, {{}}, OPENAI, marks=ReplyMarks())
    async with request.app["session"].post("http://engine" + request.path_qs, data=body) as up:
        resp = web.StreamResponse(headers={{"Content-Type": "text/event-stream"}})
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp
app = web.Application()
app.cleanup_ctx.append(session)
app.router.add_post("/v1/completions", relay)
web.run_app(app, host="127.0.0.1", port=PORT, print=None, loop=uvloop.new_event_loop())
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_port(port: int) -> None:
    for _ in range(600):
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"relay on port {port} did not start")


async def one_stream(session: aiohttp.ClientSession, port: int) -> int:
    n = 0
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json={"stream": True}) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                n += 1
    return n


async def measure(relays: dict[str, tuple[int, psutil.Process]], rounds: int) -> dict[str, list[float]]:
    us: dict[str, list[float]] = {name: [] for name in relays}
    async with aiohttp.ClientSession() as session:
        for port, _ in relays.values():
            await wait_port(port)
            await one_stream(session, port)  # warm-up
        for i in range(rounds):
            names = list(relays) if i % 2 == 0 else list(reversed(relays))
            for name in names:
                port, proc = relays[name]
                t0 = proc.cpu_times()
                n = await one_stream(session, port)
                t1 = proc.cpu_times()
                us[name].append((t1.user + t1.system - t0.user - t0.system) / n * 1e6)
    return us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=2000)
    p.add_argument("--gap-ms", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="mxr-", dir="/tmp") as tmp:
        sock = os.path.join(tmp, "e.sock")
        (Path(tmp) / "engine.py").write_text(ENGINE.format(chunk=CHUNK))
        (Path(tmp) / "relay.py").write_text(RELAY.format(root=str(ROOT)))
        procs = [subprocess.Popen([sys.executable, f"{tmp}/engine.py", sock, str(args.chunks), str(args.gap_ms / 1000)])]
        relays = {}
        try:
            for mode in ("mlxd", "aiohttp", "marked"):
                port = free_port()
                procs.append(subprocess.Popen([sys.executable, f"{tmp}/relay.py", sock, str(port), mode]))
                relays[mode] = (port, psutil.Process(procs[-1].pid))
            time.sleep(0.5)
            us = asyncio.run(measure(relays, args.rounds))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait()
    mlxd, base = statistics.median(us["mlxd"]), statistics.median(us["aiohttp"])
    print(f"{args.rounds} rounds x {args.chunks} chunks of {len(CHUNK)} bytes, {args.gap_ms} ms apart; "
          "relay CPU per chunk, median (all rounds)")
    for name in us:
        print(f"  {name:8s} {statistics.median(us[name]):7.1f} us   ({', '.join(f'{x:.0f}' for x in us[name])})")
    print(f"  ratio mlxd / aiohttp client: {mlxd / base:.2f}")
    print(f"  ratio marked (resume on: each chunk's mark stripped and kept) / mlxd: "
          f"{statistics.median(us['marked']) / mlxd:.2f}")


if __name__ == "__main__":
    main()
