"""Engine overhead vs raw mlx-lm, measured in one run on one machine.

Figures (issue 2):
  * decode tokens/s streamed through the engine socket / raw `stream_generate` (target >= 0.97)
  * time to first token over the socket minus raw time to first token (target <= 5 ms)
  * engine cold start, spawn to `ready` (aim < 3 s on the CPU test machine)

Raw and engine runs alternate (raw i, engine i, ...) so machine noise hits both alike.
The raw side runs in its own process with the same environment the engine gets
(OpenBLAS preloaded on Linux CPU). Each run uses a fresh prompt so the engine's
prompt cache cannot help it, and EOS is biased away so every run makes the same
number of tokens.

  python benchmarks/engine_decode.py                       # SmolLM2 (imported if needed)
  python benchmarks/engine_decode.py --random-llama 2048x16 --dtype bfloat16   # GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from common import logit_bias

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = (
    "{i}. Here is a short story about a lighthouse keeper who finds a message in a bottle "
    "and decides to answer it. Tell it in detail:\n"
)

RAW_WORKER = r"""
import json, sys, time
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_logits_processors
model, tok = load(sys.argv[1])
bias = make_logits_processors(logit_bias={int(k): v for k, v in json.loads(sys.argv[2]).items()})
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    ids = tok.encode(job["prompt"])
    stamps = []
    first = None
    t0 = time.perf_counter()
    for r in stream_generate(model, tok, ids, max_tokens=job["max_tokens"], logits_processors=bias):
        first = first or time.perf_counter()
        if r.text or r.finish_reason:  # what a client would see, as the engine side counts it
            stamps.append(time.perf_counter())
    print(json.dumps({"t0": t0, "stamps": stamps, "n": r.generation_tokens, "first_token_ms": (first - t0) * 1000}), flush=True)
"""


def engine_env() -> dict[str, str]:
    """What the engine runs with; the raw worker gets the same (incl. OpenBLAS preload)."""
    from mlxd.engine import blas

    env = blas.preload_env(os.environ, platform=sys.platform, cpu_wheel=blas.is_mlx_cpu_wheel(), openblas=blas.find_openblas())
    env = dict(env or os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def parse_cpus(spec: str | None) -> set[int] | None:
    """'4-7' or '2,3' -> {4, 5, 6, 7} / {2, 3}: the CPUs both sides are pinned to (None: not pinned)."""
    if not spec:
        return None
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pinned(cpus: set[int] | None) -> Any:
    """A preexec_fn that pins the child to `cpus`: the same cores for raw and engine, so that
    where the scheduler puts each process (which swings a CPU-bound decode loop by 20%+ on the
    H200 host) stops differing between the two sides."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


class RawWorker:
    """mlx-lm's stream_generate in a child process, one JSON job per line."""

    def __init__(self, model: Path, bias: dict[str, float], cpus: set[int] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RAW_WORKER, str(model), json.dumps(bias)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=engine_env(), preexec_fn=pinned(cpus),
        )
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("raw worker died")
        return json.loads(line)

    def run(self, prompt: str, max_tokens: int) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        r = self._read()
        return {**timing(r["t0"], r["stamps"], r["n"]), "first_token_ms": r["first_token_ms"]}

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def timing(t0: float, stamps: list[float], num_tokens: int) -> dict[str, float]:
    """TTFT, and the decode rate between the first token and the end of the stream."""
    if len(stamps) < 2:
        raise RuntimeError("fewer than two text chunks: cannot time decoding")
    decode_s = stamps[-1] - stamps[0]
    return {"ttft_s": stamps[0] - t0, "decode_tps": (num_tokens - 1) / decode_s, "tokens": num_tokens}


class Engine:
    """A real engine process and a streaming client over its socket."""

    def __init__(self, model: Path, model_id: str, sock_dir: Path, cpus: set[int] | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.socket = sock_dir / "bench.sock"
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxd.engine", "--model", str(model), "--model-id", model_id, "--socket", str(self.socket),
             *extra],
            env=engine_env(), stderr=subprocess.DEVNULL, preexec_fn=pinned(cpus),
        )
        self.cold_start_s = asyncio.run(self._wait_ready()) - t0
        self.bias: dict[str, float] = {}

    async def _wait_ready(self) -> float:
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}")
            try:
                connector = aiohttp.UnixConnector(path=str(self.socket))
                async with aiohttp.ClientSession(connector=connector) as s, s.get("http://e/health") as r:
                    if (await r.json())["status"] == "ready":
                        return time.perf_counter()
            except (aiohttp.ClientError, FileNotFoundError, ConnectionRefusedError):
                pass
            await asyncio.sleep(0.01)

    async def run(self, session: aiohttp.ClientSession, prompt: str, max_tokens: int) -> dict[str, float]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
                "logit_bias": self.bias, "stream_options": {"include_usage": True}}
        stamps: list[float] = []
        num_tokens = 0
        t0 = time.perf_counter()
        async with session.post("http://e/v1/completions", json=body) as resp:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    now = time.perf_counter()
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and (chunk["choices"][0]["text"] or chunk["choices"][0]["finish_reason"]):
                        stamps.append(now)
                    if chunk.get("usage"):
                        num_tokens = chunk["usage"]["completion_tokens"]
        async with session.get("http://e/admin/stats") as resp:
            inside = (await resp.json())["last"]["timings_ms"]
        # Inside the engine: submitted -> first token sampled (compare with raw first_token_ms).
        return {**timing(t0, stamps, num_tokens), "first_token_ms": inside["queue"] + inside["prefill"]}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def prepare_model(args: argparse.Namespace, work: Path) -> tuple[Path, str]:
    if args.random_llama:
        from mlxd.engine.models.random_model import build_random_llama

        hidden, layers = (int(x) for x in args.random_llama.split("x"))
        path = build_random_llama(
            work / "random", hidden_size=hidden, num_layers=layers, num_heads=hidden // 128,
            num_kv_heads=max(1, hidden // 512), intermediate_size=hidden * 11 // 4, vocab_size=4096,
            context=8192, dtype=args.dtype,
        )
        return path, f"random-llama-{args.random_llama}"
    if args.model:
        return Path(args.model), Path(args.model).name
    from mlxd.engine.models.importer import import_default
    from mlxd.paths import models_dir

    return import_default(models_dir()), "SmolLM2-135M-Instruct"


def summarize(raw: list[dict[str, float]], eng: list[dict[str, float]], cold: list[float]) -> dict[str, float]:
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {
        "raw_decode_tps": med(raw, "decode_tps"),
        "engine_decode_tps": med(eng, "decode_tps"),
        "decode_ratio": med(eng, "decode_tps") / med(raw, "decode_tps"),
        # each engine run against the raw run just before it: machine drift between runs cancels
        "paired_ratio_median": statistics.median(e["decode_tps"] / r["decode_tps"] for r, e in zip(raw, eng, strict=True)),
        "raw_ttft_ms": med(raw, "ttft_s") * 1000,
        "engine_ttft_ms": med(eng, "ttft_s") * 1000,
        "ttft_overhead_ms": (med(eng, "ttft_s") - med(raw, "ttft_s")) * 1000,
        "raw_first_token_ms": med(raw, "first_token_ms"),
        "engine_first_token_ms": med(eng, "first_token_ms"),
        "cold_start_s": statistics.median(cold),
        "tokens_per_run": med(eng, "tokens"),
    }


async def measure(engine: Engine, raw: RawWorker, runs: int, max_tokens: int) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    raw_rows, eng_rows = [], []
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(engine.socket))) as session:
        for i in range(-2, runs):  # two warm-up rounds: kernels compile on first use of each shape
            # The same fresh prompt on both sides; its leading number defeats the engine's prefix cache.
            r = raw.run(PROMPT.format(i=i), max_tokens)
            e = await engine.run(session, PROMPT.format(i=i), max_tokens)
            if i >= 0:
                raw_rows.append(r)
                eng_rows.append(e)
    return raw_rows, eng_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="MLX model dir (default: SmolLM2-135M-Instruct, imported if needed)")
    p.add_argument("--random-llama", help="HIDDENxLAYERS: benchmark a random-weight llama instead")
    p.add_argument("--dtype", default="float32", help="dtype for --random-llama")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--cold-starts", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write the summary here")
    p.add_argument("--cpus", help="pin the raw worker and the engine to these CPUs, e.g. 4-7 (Linux)")
    p.add_argument("--engine-args", default="", help="more engine flags, e.g. '--batch auto' (default: its own, batch 1)")
    args = p.parse_args()
    cpus = parse_cpus(args.cpus)
    with tempfile.TemporaryDirectory(prefix="mxb-", dir="/tmp") as tmp:
        work = Path(tmp)
        work.chmod(0o700)
        model, model_id = prepare_model(args, work)
        cold = []
        for _ in range(args.cold_starts - 1):
            e = Engine(model, model_id, work, cpus, tuple(args.engine_args.split()))
            cold.append(e.cold_start_s)
            e.stop()
        engine = Engine(model, model_id, work, cpus, tuple(args.engine_args.split()))
        cold.append(engine.cold_start_s)
        engine.bias = logit_bias(model, ascii_only=bool(args.random_llama))
        raw = RawWorker(model, engine.bias, cpus)
        try:
            raw_rows, eng_rows = asyncio.run(measure(engine, raw, args.runs, args.max_tokens))
        finally:
            raw.close()
            engine.stop()
    summary = summarize(raw_rows, eng_rows, cold)
    summary["runs"] = args.runs
    print(f"model: {model_id}  ({args.runs} runs x {args.max_tokens} tokens, medians; CPUs {args.cpus or 'not pinned'}; "
          f"engine flags: {args.engine_args or 'none'})")
    print("  engine starts, spawn to ready (s): " + " ".join(f"{c:.1f}" for c in cold))
    print("  per run, decode tok/s raw/engine: " + " ".join(f"{r['decode_tps']:.0f}/{e['decode_tps']:.0f}" for r, e in zip(raw_rows, eng_rows, strict=True)))
    for key, value in summary.items():
        print(f"  {key:20s} {value:10.3f}")
    if args.json:
        args.json.write_text(json.dumps({"model": model_id, **summary}, indent=2))


if __name__ == "__main__":
    main()
