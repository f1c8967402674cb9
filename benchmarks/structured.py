"""Structured output's cost (issue 12), against baselines of the same run.

A real engine process on one model, chat completions streamed over its socket:

  1. one stream's decode speed held to a JSON schema, against the same prompt unconstrained
     (alternating, medians; EOS biased away in both, and the schema's string long enough that
     the grammar is not complete within max_tokens, so both decode the same count);
  2. 8 streams at once, half of them held to the schema, against 8 unconstrained: aggregate
     tokens per second (rounds alternate);
  3. grammar compile time for a typical tool schema (first compile, and a cached one), and
     the llguidance tokenizer's one-time build, in this process on the model's tokenizer.

  python benchmarks/structured.py                 # SmolLM2 (imported if needed)
  python benchmarks/structured.py --model DIR     # e.g. on the GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import logit_bias  # noqa: E402
from prompt_cache import Engine  # noqa: E402

STORY = {"type": "object", "properties": {
    "title": {"type": "string"},
    "story": {"type": "string", "minLength": 4000},
}, "required": ["title", "story"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY, "strict": True}}
TOOL_SCHEMA = {  # a typical agent tool: a file edit
    "type": "object",
    "properties": {
        "path": {"type": "string", "description": "File to edit"},
        "edits": {"type": "array", "items": {"type": "object", "properties": {
            "old": {"type": "string"}, "new": {"type": "string"}, "replace_all": {"type": "boolean"}},
            "required": ["old", "new"], "additionalProperties": False}},
        "dry_run": {"type": "boolean"},
        "mode": {"type": "string", "enum": ["patch", "overwrite", "append"]},
    },
    "required": ["path", "edits"], "additionalProperties": False,
}


async def chat(engine: Engine, prompt: str, max_tokens: int, bias: dict[str, float], fmt: Any = None) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "logit_bias": bias,
            **({"response_format": fmt} if fmt else {})}
    stamps: list[float] = []
    tokens = 0
    async with engine.session() as s, s.post("http://e/v1/chat/completions", json=body) as resp:
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    spread = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    return {"tokens": tokens, "tps": (tokens - 1) / spread if spread > 0 else 0.0}


async def lone(engine: Engine, runs: int, tokens: int, bias: dict[str, float]) -> dict[str, Any]:
    free, held = [], []
    prompt = "Write a long story about a lighthouse keeper, as JSON with a title and the story."
    await chat(engine, prompt, 16, bias)  # warm-up: kernels and the grammar's compile
    await chat(engine, prompt, 16, bias, FORMAT)
    for _ in range(runs):
        free.append((await chat(engine, prompt, tokens, bias))["tps"])
        held.append((await chat(engine, prompt, tokens, bias, FORMAT))["tps"])
    return {"free_tps": statistics.median(free), "held_tps": statistics.median(held),
            "ratio": statistics.median(held) / statistics.median(free), "runs": runs, "free_all": free, "held_all": held}


async def streams(engine: Engine, rounds: int, tokens: int, bias: dict[str, float], width: int) -> dict[str, Any]:
    prompts = [f"Write story number {i} about a lighthouse keeper, as JSON with a title and the story." for i in range(width)]

    async def round_(held_share: int) -> float:
        started = time.perf_counter()
        outs = await asyncio.gather(*(chat(engine, p, tokens, bias, FORMAT if i < held_share else None)
                                      for i, p in enumerate(prompts)))
        return sum(o["tokens"] for o in outs) / (time.perf_counter() - started)

    await round_(width // 2)  # warm-up
    free, mixed = [], []
    for _ in range(rounds):
        free.append(await round_(0))
        mixed.append(await round_(width // 2))
    return {"free_tps": statistics.median(free), "half_held_tps": statistics.median(mixed),
            "ratio": statistics.median(mixed) / statistics.median(free), "rounds": rounds, "width": width}


def compile_times(model: Path) -> dict[str, float]:
    from mlx_lm.utils import load_tokenizer

    from mlxd.engine.chat.grammar import Grammars, forced_call_grammar

    tok = load_tokenizer(model)
    grammars = Grammars(tok._tokenizer, sorted(tok.eos_token_ids))
    started = time.perf_counter()
    grammars._lltokenizer()
    tokenizer_ms = (time.perf_counter() - started) * 1000
    tools = [{"type": "function", "function": {"name": "edit_file", "parameters": TOOL_SCHEMA}}]
    text = forced_call_grammar("json_tools", tools, "edit_file", "</tool_call>")
    assert text is not None
    started = time.perf_counter()
    grammars.matcher(text, "tools")
    first_ms = (time.perf_counter() - started) * 1000
    started = time.perf_counter()
    grammars.matcher(text, "tools")
    cached_ms = (time.perf_counter() - started) * 1000
    return {"llguidance_tokenizer_ms": tokenizer_ms, "tool_schema_compile_ms": first_ms, "cached_ms": cached_ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="MLX model dir (default: SmolLM2-135M-Instruct, imported if needed)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=8)
    a = p.parse_args()
    if a.model:
        model = Path(a.model)
    else:
        from mlxd.engine.models.importer import import_default
        from mlxd.paths import models_dir

        model = import_default(models_dir())
    bias = logit_bias(model, ascii_only=False)
    out: dict[str, Any] = {"model": model.name, "compile": compile_times(model)}
    print("compile:", json.dumps(out["compile"]), flush=True)

    async def measure() -> None:
        with tempfile.TemporaryDirectory(prefix="mxst-", dir=os.environ.get("MLXD_BENCH_DIR")) as tmp:
            work = Path(tmp)
            engine = await Engine.start(model, work, "--batch", str(a.width), "--ssd-cache-bytes", "0")
            try:
                out["lone"] = await lone(engine, a.runs, a.tokens, bias)
                print("one stream:", json.dumps(out["lone"]), flush=True)
                out["streams"] = await streams(engine, a.rounds, a.tokens, bias, a.width)
                print(f"{a.width} streams:", json.dumps(out["streams"]), flush=True)
            finally:
                engine.stop()

    asyncio.run(measure())
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
