"""Supervisor overhead: the same engine, straight over its socket vs through the supervisor.

Figures (issue 3):
  * added time to first token through the supervisor, p50 (target <= 2 ms)
  * streamed decode tokens/s through the supervisor / direct (target >= 0.99)
  * the same for 8 concurrent streams (total wall time, per-stream TTFT and decode)
  * supervisor start, spawn of `python -m mlxd serve` to the first 200 on /health (target <= 500 ms)
  * supervisor RSS with two engines loaded (target <= 100 MB); the engines' RSS too

One supervisor is started and one request through it spawns the engine; the direct side then
talks to that same engine over its Unix socket (`e-<sha256(model id)[:12]>.sock` in the
runtime dir). Direct and supervisor runs alternate, and which side goes first alternates too,
so machine noise hits both alike. Every request gets its own prompt (a leading request number)
so the engine's prefix cache cannot help either side; EOS is biased away so every run makes
the same number of tokens, and for random-weight models so is every non-ASCII token, so each
token arrives as visible text and is timed when it does. Warm-up rounds come first.

The engine's own speed varies from round to round by far more than the effect measured here
(+-10-20% on a 2-core VM), so each round also reads the engine's own view of that request
from its `/admin/stats`: decode time on its GPU thread for a single stream, busy time (prefill
+ decode) for a concurrent round. The decode ratio then splits into two factors,

  decode ratio = delivery ratio x engine speed ratio

where delivery is client tokens/s over the engine's tokens/s for the same request (how much
of the engine's speed reaches the client: the relay's own cost), and the engine speed ratio
compares the engine's tokens/s in the supervisor rounds with the direct rounds (machine noise,
plus CPU the supervisor takes from the engine where they share cores). Each figure comes with
a bootstrap 95% interval over rounds.

  python benchmarks/proxy_overhead.py                       # random llama 256x2, built in a temp dir
  python benchmarks/proxy_overhead.py --model ~/.local/share/mlxd/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from common import logit_bias

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxd.supervisor.engines.engine import socket_path  # noqa: E402  (after the sys.path line; never imports mlx)

PROMPT = (
    "{n:04d}. Here is a short story about a lighthouse keeper who finds a message in a bottle "
    "and decides to answer it. Tell it in detail:\n"
)
BENCH_ID = "bench"
SECOND_ID = "second"
Row = dict[str, float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


class Supervisor:
    """A real `python -m mlxd serve` on a free port, with its own runtime dir for engine sockets."""

    def __init__(self, config: Path, data_dir: Path, runtime_dir: Path, log_path: Path) -> None:
        self.port = free_port()
        self.runtime_dir = runtime_dir
        env = dict(os.environ, MLXD_RUNTIME_DIR=str(runtime_dir))
        # Python caches compiled modules unless told not to (this sandbox's shells do): without
        # the cache every spawn would compile mlxd's modules again, which no installed copy does.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
        self.log = log_path.open("ab")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxd", "serve", "--port", str(self.port), "--config", str(config),
             "--data-dir", str(data_dir)],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )
        self.children: set[int] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_health(self, timeout_s: float = 30.0) -> float:
        """Poll /health until it answers 200; seconds from spawn."""
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"supervisor exited with {self.proc.returncode} (log: {self.log.name})")
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return time.perf_counter() - self.t0
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(0.002)
        raise RuntimeError("supervisor /health did not answer in time")

    def note_children(self) -> None:
        """Remember the engines, so that stop() can make sure none outlives the run."""
        with contextlib.suppress(psutil.Error):
            self.children |= {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}

    def stop(self) -> None:
        self.note_children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.children:  # the supervisor stops its engines; this is only a safety net
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        self.log.close()


def timing(t0: float, stamps: list[float], num_tokens: int, t_end: float) -> Row:
    """TTFT, and the decode rate between the first streamed text and the end of the stream."""
    if len(stamps) < 2:
        raise RuntimeError("fewer than two text chunks: cannot time decoding")
    return {"ttft_s": stamps[0] - t0, "decode_tps": (num_tokens - 1) / (stamps[-1] - stamps[0]),
            "tokens": num_tokens, "t0": t0, "end": t_end}


async def stream(session: aiohttp.ClientSession, base: str, n: int, max_tokens: int, bias: dict[str, float]) -> Row:
    """One streaming /v1/completions request; request number `n` makes its prompt unique."""
    body = {"model": BENCH_ID, "prompt": PROMPT.format(n=n), "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "logit_bias": bias, "stream_options": {"include_usage": True}}
    stamps: list[float] = []
    num_tokens = 0
    t0 = time.perf_counter()
    async with session.post(f"{base}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{base}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if line.startswith(b"data: {"):
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"{base}: {chunk['error']}")
                if chunk["choices"] and (chunk["choices"][0]["text"] or chunk["choices"][0]["finish_reason"]):
                    stamps.append(now)
                if chunk.get("usage"):
                    num_tokens = chunk["usage"]["completion_tokens"]
    return timing(t0, stamps, num_tokens, time.perf_counter())


async def one_request(url: str, model: str, max_tokens: int) -> None:
    """A small non-streaming request through the supervisor (spawns the model's engine)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        body = {"model": model, "prompt": "hello", "max_tokens": max_tokens, "temperature": 0}
        async with s.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"loading {model}: HTTP {resp.status}: {(await resp.text())[:300]}")
            await resp.read()


class Sides:
    """The two clients: straight to the engine socket, and through the supervisor's TCP port."""

    def __init__(self, sup: Supervisor, engine_socket: Path) -> None:
        timeout = aiohttp.ClientTimeout(total=600)
        self.direct = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(engine_socket)), timeout=timeout)
        self.proxy = aiohttp.ClientSession(timeout=timeout)
        self.urls = {"direct": "http://engine", "proxy": sup.url}
        self.n = 0

    def session(self, side: str) -> aiohttp.ClientSession:
        return self.direct if side == "direct" else self.proxy

    async def engine_stats(self) -> dict[str, Any]:
        """The engine's /admin/stats, straight from its socket (outside every timed span)."""
        async with self.direct.get("http://engine/admin/stats") as resp:
            return dict(await resp.json())

    def next_n(self) -> int:
        self.n += 1
        return self.n

    async def close(self) -> None:
        await self.direct.close()
        await self.proxy.close()


async def measure_single(sides: Sides, runs: int, warmup: int, max_tokens: int, bias: dict[str, float]) -> dict[str, list[Row]]:
    rows: dict[str, list[Row]] = {"direct": [], "proxy": []}
    for i in range(-warmup, runs):
        order = ("direct", "proxy") if i % 2 == 0 else ("proxy", "direct")
        for side in order:
            r = await stream(sides.session(side), sides.urls[side], sides.next_n(), max_tokens, bias)
            decode_ms = (await sides.engine_stats())["last"]["timings_ms"]["decode"]
            r["engine_decode_tps"] = (r["tokens"] - 1) / (decode_ms / 1000)
            r["delivery"] = r["decode_tps"] / r["engine_decode_tps"]
            if i >= 0:
                rows[side].append(r)
    return rows


async def measure_concurrent(sides: Sides, runs: int, streams: int, max_tokens: int, bias: dict[str, float]) -> dict[str, list[Row]]:
    """`streams` requests at once per side; one row per round: wall time and per-stream medians."""
    rows: dict[str, list[Row]] = {"direct": [], "proxy": []}
    for i in range(-1, runs):
        order = ("direct", "proxy") if i % 2 == 0 else ("proxy", "direct")
        for side in order:
            busy0 = (await sides.engine_stats())["busy_s"]
            t0 = time.perf_counter()
            got = await asyncio.gather(*(
                stream(sides.session(side), sides.urls[side], sides.next_n(), max_tokens, bias) for _ in range(streams)
            ))
            wall = time.perf_counter() - t0
            busy = (await sides.engine_stats())["busy_s"] - busy0
            if i >= 0:
                rows[side].append({
                    "wall_s": wall,
                    "engine_busy_s": busy,
                    "delivery": busy / wall,
                    "ttft_s": statistics.median(r["ttft_s"] for r in got),
                    "first_ttft_s": min(r["ttft_s"] for r in got),
                    "decode_tps": statistics.median(r["decode_tps"] for r in got),
                    "tokens": sum(r["tokens"] for r in got),
                })
    return rows


def build_models(args: argparse.Namespace, work: Path) -> tuple[Path, Path, str]:
    """The benchmarked model (random llama 256x2 unless --model) and a second, tiny random llama."""
    from mlxd.engine.models.random_model import build_random_llama

    second = build_random_llama(work / "tiny", seed=1)
    if args.model:
        return Path(args.model).expanduser(), second, Path(args.model).name
    hidden, layers = (int(x) for x in args.random_llama.split("x"))
    path = build_random_llama(
        work / "random", hidden_size=hidden, num_layers=layers, num_heads=hidden // 128,
        num_kv_heads=max(1, hidden // 512), intermediate_size=hidden * 11 // 4, vocab_size=4096, context=8192,
        dtype=args.dtype,
    )
    return path, second, f"random llama {hidden}x{layers} ({args.dtype})"


def measure_starts(n: int, config: Path, data_dir: Path, work: Path) -> tuple[list[float], list[float], list[float]]:
    """Spawn -> first 200 on /health, the idle supervisor's RSS right after, and a baseline.

    The baseline, timed between the spawns, is `python -c "import aiohttp.web"`: the floor for
    any aiohttp server on this machine at that moment.
    """
    starts, rss, floor = [], [], []
    for i in range(-1, n):  # one warm-up spawn: the page cache then holds what python imports
        sup = Supervisor(config, data_dir, private_dir(work / "rt-start"), work / "start.log")
        try:
            took = sup.wait_health()
            if i >= 0:
                starts.append(took)
                rss.append(rss_mb(sup.proc.pid))
        finally:
            sup.stop()
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import aiohttp.web"], check=True)
        if i >= 0:
            floor.append(time.perf_counter() - t0)
    return starts, rss, floor


def pin(engine_pid: int, others: list[int]) -> str:
    """The engine alone on the last CPU, the supervisor and this client on the rest (Linux)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        return "not pinned (needs Linux and 2+ CPUs)"
    for task in psutil.Process(engine_pid).threads():  # its GPU thread and BLAS threads too
        os.sched_setaffinity(task.id, {cpus[-1]})
    for pid in others:
        for task in psutil.Process(pid).threads():
            os.sched_setaffinity(task.id, set(cpus[:-1]))
    return f"engine on CPU {cpus[-1]}, supervisor and client on CPU {cpus[0]}-{cpus[-2]}"


def rss_mb(pid: int) -> float:
    return float(psutil.Process(pid).memory_info().rss) / 2**20


def ratio_of_medians(key: str, invert: bool = False) -> Callable[[list[Row], list[Row]], float]:
    """supervisor median / direct median of `key` (direct / supervisor with `invert`: for times)."""

    def stat(d: list[Row], p: list[Row]) -> float:
        a, b = statistics.median(r[key] for r in d), statistics.median(r[key] for r in p)
        return a / b if invert else b / a

    return stat


def with_ci(name: str, d: list[Row], p: list[Row], stat: Callable[[list[Row], list[Row]], float],
            n: int = 4000) -> dict[str, float]:
    """`name`, and its bootstrap 95% interval from resampling the rounds (pairs kept together)."""
    rng = random.Random(1)
    idx = range(len(d))
    picks = (rng.choices(idx, k=len(d)) for _ in range(n))
    values = sorted(stat([d[i] for i in pick], [p[i] for i in pick]) for pick in picks)
    return {name: stat(d, p), f"{name}_lo": values[int(0.025 * n)], f"{name}_hi": values[int(0.975 * n) - 1]}


def summarize(single: dict[str, list[Row]], conc: dict[str, list[Row]], cpu_us: float) -> dict[str, float]:
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    d, p, cd, cp = single["direct"], single["proxy"], conc["direct"], conc["proxy"]
    return {
        "direct_ttft_ms": med(d, "ttft_s") * 1000,
        "proxy_ttft_ms": med(p, "ttft_s") * 1000,
        "ttft_added_ms": (med(p, "ttft_s") - med(d, "ttft_s")) * 1000,
        # Paired: each round's proxy minus its direct partner (same round, adjacent in time).
        "ttft_added_paired_ms": statistics.median(b["ttft_s"] - a["ttft_s"] for a, b in zip(d, p, strict=True)) * 1000,
        "direct_decode_tps": med(d, "decode_tps"),
        "proxy_decode_tps": med(p, "decode_tps"),
        **with_ci("decode_ratio", d, p, ratio_of_medians("decode_tps")),
        "decode_ratio_paired": statistics.median(b["decode_tps"] / a["decode_tps"] for a, b in zip(d, p, strict=True)),
        **with_ci("delivery_ratio", d, p, ratio_of_medians("delivery")),
        **with_ci("engine_speed_ratio", d, p, ratio_of_medians("engine_decode_tps")),
        "tokens_per_run": med(p, "tokens"),
        "supervisor_cpu_us_per_token": cpu_us,
        "conc_direct_wall_s": med(cd, "wall_s"),
        "conc_proxy_wall_s": med(cp, "wall_s"),
        "conc_wall_ratio": med(cp, "wall_s") / med(cd, "wall_s"),
        "conc_direct_ttft_ms": med(cd, "ttft_s") * 1000,
        "conc_proxy_ttft_ms": med(cp, "ttft_s") * 1000,
        "conc_ttft_added_ms": (med(cp, "ttft_s") - med(cd, "ttft_s")) * 1000,
        "conc_first_ttft_added_ms": (med(cp, "first_ttft_s") - med(cd, "first_ttft_s")) * 1000,
        "conc_direct_decode_tps": med(cd, "decode_tps"),
        "conc_proxy_decode_tps": med(cp, "decode_tps"),
        "conc_decode_ratio": med(cp, "decode_tps") / med(cd, "decode_tps"),
        **with_ci("conc_throughput_ratio", cd, cp, ratio_of_medians("wall_s", invert=True)),
        "conc_throughput_ratio_paired": statistics.median(a["wall_s"] / b["wall_s"] for a, b in zip(cd, cp, strict=True)),
        **with_ci("conc_delivery_ratio", cd, cp, ratio_of_medians("delivery")),
        **with_ci("conc_engine_speed_ratio", cd, cp, ratio_of_medians("engine_busy_s", invert=True)),
    }


async def bench_engine(sup: Supervisor, args: argparse.Namespace, bias: dict[str, float]) -> tuple[dict[str, list[Row]], dict[str, list[Row]], float]:
    await one_request(sup.url, BENCH_ID, 4)  # spawns the engine through the supervisor
    engine_socket = socket_path(sup.runtime_dir, BENCH_ID)
    if not engine_socket.exists():
        raise RuntimeError(f"no engine socket at {engine_socket}")
    sup.note_children()
    if args.pin:
        (engine_pid,) = [c.pid for c in psutil.Process(sup.proc.pid).children() if c.is_running()]
        print("pinning:", pin(engine_pid, [sup.proc.pid, os.getpid()]))
    sides = Sides(sup, engine_socket)
    me = psutil.Process(sup.proc.pid)
    try:
        cpu0 = me.cpu_times()
        single = await measure_single(sides, args.runs, 2, args.max_tokens, bias)
        cpu1 = me.cpu_times()
        conc = await measure_concurrent(sides, args.concurrent_runs, args.streams, args.max_tokens, bias)
    finally:
        await sides.close()
    # The supervisor's CPU per token it relayed in the single-stream phase (warm-up included).
    relayed = (args.runs + 2) * args.max_tokens
    cpu_us = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / relayed * 1e6
    return single, conc, cpu_us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="MLX model dir to benchmark (default: a random llama 256x2 built in a temp dir)")
    p.add_argument("--random-llama", default="256x2", help="HIDDENxLAYERS of the random model (default 256x2)")
    p.add_argument("--dtype", default="float32", help="its dtype (bfloat16 on a GPU)")
    p.add_argument("--runs", type=int, default=9, help="single-stream rounds per side (after 2 warm-up rounds)")
    p.add_argument("--concurrent-runs", type=int, default=4, help="concurrent rounds per side (after 1 warm-up)")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams per round")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--starts", type=int, default=5, help="supervisor cold starts to time")
    p.add_argument("--pin", action="store_true",
                   help="give the engine a CPU of its own, as on a machine with more cores than 2 (Linux)")
    p.add_argument("--json", type=Path, help="also write the summary here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="mxp-", dir="/tmp") as tmp:
        work = private_dir(Path(tmp))
        model, second, model_name = build_models(args, work)
        bias = logit_bias(model, ascii_only=not args.model)
        config = work / "mlxd.toml"
        config.write_text(f'[models.{BENCH_ID}]\npath = "{model}"\n\n[models.{SECOND_ID}]\npath = "{second}"\n')
        data_dir = private_dir(work / "data")

        starts, idle_rss, floor = measure_starts(args.starts, config, data_dir, work)

        sup = Supervisor(config, data_dir, private_dir(work / "rt"), work / "serve.log")
        try:
            sup.wait_health()
            single, conc, cpu_us = asyncio.run(bench_engine(sup, args, bias))
            asyncio.run(one_request(sup.url, SECOND_ID, 4))  # the second engine
            sup.note_children()
            engines = psutil.Process(sup.proc.pid).children()
            supervisor_rss = rss_mb(sup.proc.pid)
            engine_rss = sorted(rss_mb(c.pid) for c in engines)
        except Exception:
            print(f"failed; supervisor log follows ({work / 'serve.log'}):", file=sys.stderr)
            with contextlib.suppress(OSError):
                print((work / "serve.log").read_text()[-4000:], file=sys.stderr)
            raise
        finally:
            sup.stop()

    summary = summarize(single, conc, cpu_us)
    summary |= {
        "start_to_health_ms": statistics.median(starts) * 1000,
        "start_to_health_min_ms": min(starts) * 1000,
        "start_to_health_max_ms": max(starts) * 1000,
        "baseline_import_aiohttp_ms": statistics.median(floor) * 1000,
        "start_vs_baseline_ratio": statistics.median(starts) / statistics.median(floor),
        "supervisor_idle_rss_mb": statistics.median(idle_rss),
        "supervisor_rss_mb": supervisor_rss,
        "engines_loaded": float(len(engines)),
    }
    for i, mb in enumerate(engine_rss):
        summary[f"engine{i}_rss_mb"] = mb
    print(f"model: {model_name}  ({args.runs} runs x {args.max_tokens} tokens single; "
          f"{args.concurrent_runs} rounds x {args.streams} streams concurrent; medians)")
    sections = [
        ("single stream (direct socket vs supervisor)", "direct_ttft_ms", "supervisor_cpu_us_per_token"),
        (f"{args.streams} concurrent streams (served one after another: median TTFT is mostly queueing)",
         "conc_direct_wall_s", "conc_engine_speed_ratio_hi"),
        (f"supervisor start ({args.starts} spawns) and memory", "start_to_health_ms", None),
    ]
    keys = list(summary)
    for title, first, last in sections:
        print(f" {title}")
        end = keys.index(last) + 1 if last else len(keys)
        for key in keys[keys.index(first):end]:
            print(f"  {key:26s} {summary[key]:10.3f}")
    ci = lambda k: f" [95% CI {summary[k + '_lo']:.3f}-{summary[k + '_hi']:.3f}]"  # noqa: E731
    targets = [
        ("added TTFT p50 <= 2 ms", summary["ttft_added_ms"] <= 2.0),
        ("decode ratio >= 0.99" + ci("decode_ratio"), summary["decode_ratio"] >= 0.99),
        ("  its delivery factor >= 0.99" + ci("delivery_ratio"), summary["delivery_ratio"] >= 0.99),
        (f"{args.streams} streams: decode ratio >= 0.99", summary["conc_decode_ratio"] >= 0.99),
        (f"{args.streams} streams: throughput (wall) ratio >= 0.99" + ci("conc_throughput_ratio"),
         summary["conc_throughput_ratio"] >= 0.99),
        ("  its delivery factor >= 0.99" + ci("conc_delivery_ratio"), summary["conc_delivery_ratio"] >= 0.99),
        (f"{args.streams} streams: first stream's added TTFT <= 2 ms", summary["conc_first_ttft_added_ms"] <= 2.0),
        ("start to /health <= 500 ms", summary["start_to_health_ms"] <= 500),
        ("supervisor RSS, 2 engines <= 100 MB", summary["supervisor_rss_mb"] <= 100),
    ]
    print(" targets:")
    for name, ok in targets:
        print(f"  {name}: {'met' if ok else 'MISSED'}")
    if args.json:
        args.json.write_text(json.dumps({"model": model_name, "runs": args.runs, "max_tokens": args.max_tokens,
                                         "streams": args.streams, **summary,
                                         "rows": {"single": single, "concurrent": conc, "starts_s": starts, "baseline_s": floor}}, indent=2))


if __name__ == "__main__":
    main()
