"""The prompt cache's figures (issue 11), all measured in one run against baselines of the same run.

Real engine processes on one model, streaming completions over the engine socket:

  1. time to first token (TTFT) of a prompt with a long shared prefix: cold (nothing cached),
     with a RAM hit, and after the engine is restarted on the same SSD dir (an SSD restore:
     what a model swapped away and back, or a restart of mlxd, finds);
  2. two clients alternating, each with its own long prefix and a growing history: the
     cached tokens of every turn;
  3. a drain right after a burst of requests (write-behind off, so the drain writes them all):
     MB/s written, next to the disk's raw write speed (as many bytes in 8 MB chunks to one file,
     fsynced, in the same dir);
  4. decode speed of a request that starts while the idle engine writes a large entry behind,
     against the same request on an engine with no SSD tier (alternating, medians);
  5. with --kv-bits: SSD bytes per token and TTFT after a restart, against full precision.

With --warmup-tokens N every engine of parts 1 and 5 first serves a cold prompt of N tokens of
its own and a hit on it, so that kernels compiled on first use of a shape (MLX's CUDA backend
JIT-compiles them) are not timed; its text shares no prefix with anything measured.

  python benchmarks/prompt_cache.py                                   # SmolLM2, 6k-token prefix
  python benchmarks/prompt_cache.py --model DIR --prefix-tokens 16000 # e.g. on the GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_decode import engine_env  # noqa: E402

WORDS = ["river", "stone", "lantern", "harbor", "meadow", "copper", "signal", "orchard", "winter", "engine", "violet", "canyon", "thunder", "pocket", "marble", "garden", "ladder", "silver", "planet", "window", "ember", "forest", "bridge", "candle"]


def text_of(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Engine:
    """A real engine process on a Unix socket (`await Engine.start(...)`)."""

    def __init__(self, model: Path, work: Path, *flags: str) -> None:
        import subprocess

        self.socket = work / f"e{os.getpid()}-{time.monotonic_ns() % 10**9}.sock"
        logs = Path(os.environ.get("MLXD_BENCH_LOGS") or work)
        logs.mkdir(parents=True, exist_ok=True)
        self.log = open(logs / f"{self.socket.stem}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxd.engine", "--model", str(model), "--model-id", "m", "--socket",
             str(self.socket), *flags], env=engine_env(), stdout=self.log, stderr=subprocess.STDOUT,
        )

    @classmethod
    async def start(cls, model: Path, work: Path, *flags: str) -> Engine:
        engine = cls(model, work, *flags)
        for _ in range(6000):
            if engine.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {engine.proc.returncode}")
            try:
                async with engine.session() as s, s.get("http://e/health") as r:
                    if (await r.json())["status"] == "ready":
                        return engine
            except (aiohttp.ClientError, FileNotFoundError, ConnectionRefusedError):
                pass
            await asyncio.sleep(0.05)
        raise TimeoutError("engine not ready")

    def session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(self.socket)),
                                     timeout=aiohttp.ClientTimeout(total=3600))

    async def complete(self, prompt: str, max_tokens: int = 4, bias: dict[str, float] | None = None) -> dict[str, Any]:
        """Stream one completion: TTFT (s), decode tok/s, prompt and cached tokens."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "logit_bias": bias or {}}
        stamps: list[float] = []
        usage: dict[str, Any] = {}
        async with self.session() as s:
            t0 = time.perf_counter()
            async with s.post("http://e/v1/completions", json=body) as resp:
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(f"the engine answered an error: {chunk['error']}")
                    if chunk["choices"] and chunk["choices"][0]["text"]:
                        stamps.append(time.perf_counter())
                    usage = chunk.get("usage") or usage
        n = usage.get("completion_tokens", 0)
        decode = (n - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else 0.0
        return {"ttft_s": (stamps[0] if stamps else time.perf_counter()) - t0, "decode_tps": decode,
                "prompt": usage.get("prompt_tokens", 0),
                "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}

    async def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        async with self.session() as s, s.request(method, f"http://e{path}", json=body) as r:
            return dict(await r.json())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def raw_write_mb_s(dir_: Path, nbytes: int) -> float:
    """The disk's own speed for what a drain does: `nbytes` in 8 MB chunks, fsync, in `dir_`."""
    chunk = os.urandom(8 * 1024 * 1024)
    path = dir_ / "raw-write.bin"
    started = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(chunk[: min(left, len(chunk))])
            left -= len(chunk)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return nbytes / 1e6 / seconds


def words_for(tokens: int) -> int:
    return int(tokens / 1.04)  # these words are ~1.04 tokens each with SmolLM2's tokenizer


WARMUP_TOKENS = 0  # --warmup-tokens
T0 = time.perf_counter()


async def warm_up(engine: Engine, seed: int) -> None:
    """Kernels are compiled on first use of each shape (MLX's CUDA backend JIT-compiles them):
    a cold prompt of its own and a hit on it, before anything is timed. Its text shares no
    prefix with the measured prompts, nor with another engine's warm-up (no SSD restore)."""
    if WARMUP_TOKENS:
        text = text_of(words_for(WARMUP_TOKENS), seed=10_000 + seed)
        await engine.complete(f"{text} warm-up a:")
        await engine.complete(f"{text} warm-up b:")


def bytes_per_token(kv: Path) -> float:
    """The tier's files: bytes over the tokens they hold (each file's header lists its tokens)."""
    from mlxd.engine.cache import kv_files

    files = [f for f in kv.glob("*/*.safetensors")]
    tokens = sum(len(kv_files.read_header(f).tokens) for f in files)
    return sum(f.stat().st_size for f in files) / max(1, tokens)


async def ttft_figures(model: Path, work: Path, kv: Path, prefix: str, runs: int, flags: tuple[str, ...]) -> dict[str, Any]:
    """Cold, RAM-hit and SSD-restore TTFT for prompts sharing `prefix` (medians)."""
    cold, ram, ssd = [], [], []
    per_token = 0.0
    for run in range(runs):
        shutil.rmtree(kv, ignore_errors=True)
        engine = await Engine.start(model, work, "--ssd-cache-dir", str(kv), *flags)
        try:
            await warm_up(engine, 2 * run)
            cold.append(await engine.complete(f"{prefix} question {run}a:"))
            ram.append(await engine.complete(f"{prefix} question {run}b:"))
            await engine.admin("POST", "/admin/drain", {"resume": True})
            written = (await engine.admin("GET", "/admin/stats"))["prompt_cache"]["ssd"]  # after the drain
            per_token = bytes_per_token(kv)
        finally:
            engine.stop()
        engine = await Engine.start(model, work, "--ssd-cache-dir", str(kv), *flags)  # a restart (or a swap back)
        try:
            await warm_up(engine, 2 * run + 1)
            ssd.append(await engine.complete(f"{prefix} question {run}c:"))
            stats = (await engine.admin("GET", "/admin/stats"))["prompt_cache"]
        finally:
            engine.stop()
    med = lambda rows: statistics.median(r["ttft_s"] for r in rows) * 1000  # noqa: E731
    return {
        "prompt_tokens": cold[0]["prompt"], "cached_ram": ram[0]["cached"], "cached_ssd": ssd[0]["cached"],
        "cold_ms": med(cold), "ram_ms": med(ram), "ssd_ms": med(ssd),
        "ram_share": med(ram) / med(cold), "ssd_share": med(ssd) / med(cold),
        "ssd_bytes": written["bytes"], "ssd_entries": written["entries"], "restore_ms": stats["ssd"]["restore_ms"],
        "restores": stats["ssd"]["restores"], "bytes_per_token": per_token, "warmup_tokens": WARMUP_TOKENS,
    }


async def alternating(engine: Engine, prefix_tokens: int, turns: int) -> list[list[int]]:
    """Two clients, each its own prefix, alternating turns with growing histories."""
    history = {c: text_of(words_for(prefix_tokens), seed=100 + i) for i, c in enumerate("AB")}
    cached: dict[str, list[int]] = {"A": [], "B": []}
    for turn in range(turns):
        for c in "AB":
            history[c] += f"\nQ{turn}: and then?\nA{turn}:"
            r = await engine.complete(history[c], max_tokens=8)
            cached[c].append(r["cached"])
            history[c] += " " + text_of(6, seed=turn)  # the client's own record of the reply
    return [cached["A"], cached["B"]]


async def drain_figures(engine: Engine, prefix_tokens: int, burst: int) -> dict[str, Any]:
    """A burst of `burst` requests with their own prefixes, then a drain at once."""
    prompts = [text_of(words_for(prefix_tokens), seed=500 + i) for i in range(burst)]
    await asyncio.gather(*(engine.complete(p) for p in prompts))
    report = await engine.admin("POST", "/admin/drain", {"resume": True, "timeout_s": 600})
    mb = report["cache_written_bytes"] / 1e6
    return {"entries": report["cache_written_entries"], "mb": mb, "ms": report["cache_write_ms"],
            "mb_s": mb / (report["cache_write_ms"] / 1000) if report["cache_write_ms"] else 0.0}


async def decode_figures(model: Path, work: Path, kv: Path, prefix: str, runs: int, bias: dict[str, float]) -> dict[str, Any]:
    """Decode tok/s of a request that arrives while a large entry is being written behind,
    against an engine with no SSD tier; engines alternate, medians."""
    with_tier, without = [], []
    on = await Engine.start(model, work, "--ssd-cache-dir", str(kv))
    off = await Engine.start(model, work, "--ssd-cache-bytes", "0")
    try:
        for engine in (on, off):  # the decode shapes' kernels, compiled before timing
            await engine.complete("Tell a story, to warm up:", max_tokens=128, bias=bias)
        for run in range(runs):
            for engine, rows in ((on, with_tier), (off, without)):
                await engine.complete(f"{run} {prefix}")  # a large new entry: written behind once idle
                await asyncio.sleep(0.05)  # the writer has started
                r = await engine.complete(f"Tell a story {run}:", max_tokens=128, bias=bias)
                rows.append(r["decode_tps"])
        stats = (await on.admin("GET", "/admin/stats"))["prompt_cache"]["ssd"]
    finally:
        on.stop()
        off.stop()
    return {"with_write_behind_tps": statistics.median(with_tier), "ssd_off_tps": statistics.median(without),
            "ratio": statistics.median(with_tier) / statistics.median(without), "writes": stats["writes"]}


async def alt_and_drain(model: Path, work: Path, kv: Path, a: argparse.Namespace, skip: set[str],
                        out: dict[str, Any]) -> None:
    # Write-behind off: the drain writes every entry of the burst (else the idle engine starts first).
    engine = await Engine.start(model, work, "--ssd-cache-dir", str(kv), "--batch", "4", "--ssd-write-behind", "off")
    try:
        if "alt" not in skip:
            out["alternating_cached"] = await alternating(engine, a.alt_tokens, a.turns)
            print(f"[{time.perf_counter() - T0:.0f} s]", "alternating cached tokens (A, B):", out["alternating_cached"], flush=True)
        if "drain" not in skip:
            drain = await drain_figures(engine, a.alt_tokens, a.burst)
            drain["raw_mb_s"] = raw_write_mb_s(kv, int(drain["mb"] * 1e6))
            drain["share_of_raw"] = drain["mb_s"] / drain["raw_mb_s"]
            out["drain"] = drain
            print(f"[{time.perf_counter() - T0:.0f} s]", "drain:", json.dumps(drain), flush=True)
    finally:
        engine.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="MLX model dir (default: SmolLM2-135M-Instruct, imported if needed)")
    p.add_argument("--prefix-tokens", type=int, default=6000)
    p.add_argument("--alt-tokens", type=int, default=4000, help="each alternating client's prefix")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--decode-runs", type=int, help="runs of the decode part (default: --runs)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--burst", type=int, default=4)
    p.add_argument("--kv-bits", type=int, default=8)
    p.add_argument("--kv-group-size", type=int, default=64)
    p.add_argument("--warmup-tokens", type=int, default=0,
                   help="before timing TTFT, each engine serves a cold prompt this long and a hit on it "
                        "(compiles the kernels of those shapes; 0: none)")
    p.add_argument("--logs", help="keep the engines' logs in this dir")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: ttft,alt,drain,decode,kv")
    a = p.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    global WARMUP_TOKENS
    WARMUP_TOKENS = a.warmup_tokens
    if a.logs:
        os.environ["MLXD_BENCH_LOGS"] = a.logs
    if a.model:
        model = Path(a.model)
    else:
        from mlxd.engine.models.importer import import_default
        from mlxd.paths import models_dir

        model = import_default(models_dir())
    from common import logit_bias

    bias = logit_bias(model, ascii_only=False)
    prefix = text_of(words_for(a.prefix_tokens), seed=1)
    out: dict[str, Any] = {"model": model.name}
    with tempfile.TemporaryDirectory(prefix="mxpc-", dir=os.environ.get("MLXD_BENCH_DIR")) as tmp:
        work = Path(tmp)
        work.chmod(0o700)
        kv = work / "kv"
        if "ttft" not in skip:
            out["ttft"] = asyncio.run(ttft_figures(model, work, kv, prefix, a.runs, ()))
            print(f"[{time.perf_counter() - T0:.0f} s]", "ttft:", json.dumps(out["ttft"]), flush=True)
        if "alt" not in skip or "drain" not in skip:
            shutil.rmtree(kv, ignore_errors=True)
            asyncio.run(alt_and_drain(model, work, kv, a, skip, out))
        if "decode" not in skip:
            shutil.rmtree(kv, ignore_errors=True)
            out["decode"] = asyncio.run(decode_figures(model, work, kv, prefix, a.decode_runs or a.runs, bias))
            print(f"[{time.perf_counter() - T0:.0f} s]", "decode while writing behind:", json.dumps(out["decode"]), flush=True)
        if "kv" not in skip:
            flags = ("--kv-bits", str(a.kv_bits), "--kv-group-size", str(a.kv_group_size))
            try:
                quant = asyncio.run(ttft_figures(model, work, work / "kvq", prefix, 1, flags))
            except RuntimeError as exc:  # e.g. a backend without the quantized attention's kernels
                out["kv_quantization"] = {"bits": a.kv_bits, "group_size": a.kv_group_size, "error": str(exc)}
                print(f"[{time.perf_counter() - T0:.0f} s]", "kv quantization failed:", exc, flush=True)
                print(json.dumps(out, indent=2))
                return
            full = out.get("ttft") or asyncio.run(ttft_figures(model, work, kv, prefix, 1, ()))
            out["kv_quantization"] = {
                "bits": a.kv_bits, "group_size": a.kv_group_size, "bytes_per_token": quant["bytes_per_token"],
                "full_bytes_per_token": full["bytes_per_token"],
                "restore_ttft_ms": quant["ssd_ms"], "full_restore_ttft_ms": full["ssd_ms"],
                "cold_ms": quant["cold_ms"], "full_cold_ms": full["cold_ms"],
            }
            print(f"[{time.perf_counter() - T0:.0f} s]", "kv quantization:", json.dumps(out["kv_quantization"]), flush=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
