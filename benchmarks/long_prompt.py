"""A lone long prompt: time to first token and decode speed, engine vs raw mlx-lm, one run.

Figures (issue 24, "long contexts at raw speed"), at each prompt length (`--lengths`):
  * TTFT: the engine's own (submitted -> first token sampled, from its usage report) against
    raw `stream_generate`'s (call -> first token), target <= 1.05x;
  * decode tokens/s after the first token, engine / raw, target >= 0.95x.

The raw side is mlx-lm as a user runs it: `stream_generate` at its defaults (prefill chunks of
2048 tokens, MLX's own settings, so cuDNN's attention on CUDA), in a worker process of its own.
The engine is `python -m mlxd.engine` at its defaults plus `--engine-args`, with no prompt
cache, over its socket. Each run's prompt is fresh random token ids (the same ids on both
sides), EOS biased away; the two sides alternate, raw first, after one warm-up round at every
length (kernels and shapes compile on first use on a GPU).

  python benchmarks/long_prompt.py --model /tmp/models/l1b --lengths 8000,24000 --runs 3
  python benchmarks/long_prompt.py ... --engine-env MLX_CUDA_USE_CUDNN_SDPA=1 --engine-args "--prefill-step 2048"
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:
    import httpx2 as httpx
except ImportError:  # the GPU machine's image has httpx only
    import httpx  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import env_pairs  # noqa: E402

RAW_WORKER = r"""
import json, sys, time
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_logits_processors
model, tok = load(sys.argv[1])
calls = []
_call = type(model).__call__
def stamped(self, *a, **k):
    calls.append(time.perf_counter())
    return _call(self, *a, **k)
type(model).__call__ = stamped
eos = sorted(set(json.loads(sys.argv[2])) | set(tok.eos_token_ids))
bias = make_logits_processors(logit_bias={t: -100.0 for t in eos})
print(json.dumps({"eos": eos}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    stamps = []
    calls.clear()
    t0 = time.perf_counter()
    for r in stream_generate(model, tok, job["ids"], max_tokens=job["max_tokens"], logits_processors=bias):
        stamps.append(time.perf_counter())
    mx.clear_cache()
    print(json.dumps({"ttft_ms": (stamps[0] - t0) * 1000, "n": len(stamps),
                      "decode_tps": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
                      "calls_ms": [round((c - t0) * 1000, 1) for c in calls if c <= stamps[0]]}), flush=True)
"""


def env_with(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.update(extra)
    return env


class RawWorker:
    def __init__(self, model: Path, eos: list[int], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", RAW_WORKER, str(model), json.dumps(eos)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        # mlx-lm's EOS ids (config, generation config, tokenizer): biased away on both sides
        self.eos: list[int] = self._read()["eos"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("raw worker died")
        return dict(json.loads(line))

    def run(self, ids: list[int], max_tokens: int) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"ids": ids, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Engine:
    def __init__(self, model: Path, sock_dir: Path, extra: list[str], env: dict[str, str], log: Path) -> None:
        self.socket = sock_dir / "e.sock"
        self.trace = sock_dir / "steps.jsonl"  # the GPU thread's turns (MLXD_TRACE_STEPS)
        self._trace_seen = 0
        env = {**env, "MLXD_TRACE_STEPS": str(self.trace)}
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxd.engine", "--model", str(model), "--model-id", "bench", "--socket",
             str(self.socket), "--prompt-cache-bytes", "0", *extra], env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)), base_url="http://e", timeout=600)
        t0 = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
                raise RuntimeError(f"engine exited with {self.proc.returncode}; log: {log}\n{tail}")
            try:
                if self.socket.exists() and self.client.get("/health").json()["status"] == "ready":
                    break
            except httpx.TransportError:
                pass
            if time.perf_counter() - t0 > 600:
                raise RuntimeError("engine not ready in 600 s")
            time.sleep(0.05)
        self.ready_s = time.perf_counter() - t0

    def run(self, ids: list[int], max_tokens: int, bias: dict[str, float]) -> dict[str, float]:
        resp = self.client.post("/v1/completions", json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                                                          "logit_bias": bias})
        resp.raise_for_status()
        usage = json.loads(resp.headers["x-mlxd-usage"])
        n = usage["completion_tokens"]
        lines = self.trace.read_text().splitlines() if self.trace.exists() else []
        turns = [json.loads(x) for x in lines[self._trace_seen:]]
        self._trace_seen = len(lines)
        # the turns up to the first token: one prefill chunk each (the last one samples the token)
        first: list[float] = []
        for t in turns:
            if first or t.get("admitted", 0) or t.get("prefilling", 0):
                first.append(round(t["ms"], 1))
                if not t.get("prefilling", 0):
                    break
        return {"ttft_ms": usage["queue_ms"] + usage["prefill_ms"], "n": n, "queue_ms": usage["queue_ms"],
                "decode_tps": (n - 1) / (usage["decode_ms"] / 1000), "turns_ms": first}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.client.close()
        self._log.close()


def config_eos(model: Path) -> tuple[list[int], int]:
    """The EOS ids the model's config files name, and its vocabulary size."""
    config = json.loads((model / "config.json").read_text())
    eos: list[int] = []
    for source in (config, json.loads(gen.read_text()) if (gen := model / "generation_config.json").exists() else {}):
        ids = source.get("eos_token_id", [])
        eos += ids if isinstance(ids, list) else [ids]
    return eos, int(config["vocab_size"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--lengths", default="8000,24000", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--engine-args", default="", help="more engine flags, e.g. '--prefill-step 2048'")
    p.add_argument("--engine-env", default="", help="NAME=VALUE[,NAME=VALUE] for the engine only")
    p.add_argument("--raw-env", default="", help="NAME=VALUE[,NAME=VALUE] for the raw worker only")
    p.add_argument("--json", type=Path)
    p.add_argument("--trace", action="store_true",
                   help="print each run's raw model-call times and the engine's GPU-thread turns up to the first token")
    p.add_argument("--keep-trace", type=Path, help="copy the engine's step trace (every GPU-thread turn) here")
    args = p.parse_args()

    lengths = [int(x) for x in args.lengths.split(",")]
    eos, vocab = config_eos(args.model)
    rng = random.Random(0)
    work = Path(tempfile.mkdtemp(prefix="lp-", dir="/tmp"))
    raw = RawWorker(args.model, eos, env_with(env_pairs(args.raw_env)))
    bias = {str(t): -100.0 for t in raw.eos}
    engine = Engine(args.model, work, args.engine_args.split(), env_with(env_pairs(args.engine_env)), work / "engine.log")
    print(f"engine ready in {engine.ready_s:.1f} s ({args.engine_args or 'defaults'}; env {args.engine_env or '-'})",
          flush=True)
    for line in (work / "engine.log").read_text(errors="replace").splitlines():
        if "KV budget" in line or "warm-up:" in line:
            print("  engine:", line.split("mlxd.engine: ", 1)[-1][:400], flush=True)
    rows: dict[int, dict[str, list[dict[str, float]]]] = {n: {"raw": [], "engine": []} for n in lengths}
    try:
        for i in range(-1, args.runs):  # one warm-up round
            for n in lengths:
                ids = [rng.randrange(100, vocab - 100) for _ in range(n)]
                r = raw.run(ids, args.max_tokens)
                e = engine.run(ids, args.max_tokens, bias)
                if i >= 0:
                    rows[n]["raw"].append(r)
                    rows[n]["engine"].append(e)
                print(f"  {n} tokens, run {i}: raw ttft {r['ttft_ms']:.0f} ms {r['decode_tps']:.1f} tok/s; "
                      f"engine ttft {e['ttft_ms']:.0f} ms (queue {e['queue_ms']:.1f}) {e['decode_tps']:.1f} tok/s",
                      flush=True)
                if args.trace:
                    print(f"    raw model calls at ms {r['calls_ms']}; engine turns ms {e['turns_ms']}", flush=True)
    finally:
        engine.stop()
        raw.close()
        if args.keep_trace and engine.trace.exists():
            shutil.copyfile(engine.trace, args.keep_trace)
    med = statistics.median
    summary = []
    print("\n| prompt tokens | raw TTFT ms | engine TTFT ms | TTFT engine/raw | raw tok/s | engine tok/s | decode engine/raw |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in lengths:
        r, e = rows[n]["raw"], rows[n]["engine"]
        ttft = med(x["ttft_ms"] for x in e) / med(x["ttft_ms"] for x in r)
        # paired: each engine run against the raw run just before it
        dec = med(b["decode_tps"] / a["decode_tps"] for a, b in zip(r, e, strict=True))
        line = (n, med(x["ttft_ms"] for x in r), med(x["ttft_ms"] for x in e), ttft, med(x["decode_tps"] for x in r),
                med(x["decode_tps"] for x in e), dec)
        summary.append(dict(zip(["tokens", "raw_ttft_ms", "engine_ttft_ms", "ttft_ratio", "raw_tps", "engine_tps",
                                 "decode_ratio"], line, strict=True)))
        print(f"| {n} | {line[1]:.0f} | {line[2]:.0f} | {line[3]:.2f} | {line[4]:.1f} | {line[5]:.1f} | {line[6]:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"model": str(args.model), "json": str(args.json)},
                                         "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
