"""A batched prefill's time and memory at MLX's own limits against the engine's (issue 29's
out-of-memory on an H100: docs/benchmarks.md, "Where the memory went").

The batch lane prefills rows that arrive together in one chunk of `--chunk` queries a row.
This script does the same with mlx-lm's batch cache, outside any engine, in two settings:

- `mlx`: MLX's default memory limit (95% of a GPU) and the unfused attention over all rows at
  once (`SCORES_BLOCK_BYTES` unbounded): the engine before the fix;
- `engine`: the memory limit an engine sets (`device_memory.memory_limit_bytes`) and the
  attention's scores a group of rows at a time: the engine now.

Turns go engine, mlx, engine, mlx (`--turns`), each a warm-up prefill and `--runs` timed ones;
each prints the median time, MLX's peak, and on CUDA the memory pool's high mark and the card.
A failed prefill (out of memory) is reported, not raised.

    python benchmarks/prefill_memory.py --model /tmp/models/l8q              # 8 rows of 4,574 tokens
    python benchmarks/prefill_memory.py --rows 2 --tokens 300 --chunk 128   # the tiny model, on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def prefill(model: Any, rows: int, tokens: int, chunk: int, vocab: int) -> float:
    """Seconds to prefill `rows` prompts of up to `tokens` tokens (left-padded: each row 37 fewer
    than the one before) into a fresh batch cache, a chunk at a time as mlx-lm's BatchGenerator does."""
    from mlx_lm.models.cache import BatchKVCache

    padding = [min(i * 37, tokens - 1) for i in range(rows)]
    cache = [BatchKVCache(padding) for _ in model.layers]
    prompt = mx.random.randint(0, vocab, (rows, tokens), key=mx.random.key(rows * tokens))
    mx.eval(prompt)
    started = time.perf_counter()
    for at in range(0, tokens, chunk):
        model(prompt[:, at:at + chunk], cache=cache)
        mx.eval([c.state for c in cache])
    took = time.perf_counter() - started
    del cache
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model dir (default: the tiny random llama, built here)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4574)
    p.add_argument("--chunk", type=int, default=2048, help="queries a row per chunk (the engine's solo chunk)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--turns", type=int, default=2)
    a = p.parse_args()

    from mlx_lm import load

    from mlxd.engine.gpu import decode_attention, prefill_attention
    from mlxd.engine.gpu.cuda_memory import cuda_memory
    from mlxd.engine.gpu.device_memory import memory_limit_bytes, release_unused
    from mlxd.engine.gpu.options import GatewayOptions
    from mlxd.engine.models.random_model import build_random_llama

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(a.model) if a.model else build_random_llama(Path(tmp) / "tiny", context=max(4096, a.tokens))
        model, tokenizer = load(str(path))
    routed = decode_attention.install(model) if mx.cuda.is_available() else []
    vocab = len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else 1000
    mlx_limit = mx.get_memory_limit()  # MLX's own
    settings = {"mlx": (mlx_limit, 1 << 62),
                "engine": (memory_limit_bytes(GatewayOptions()) or mlx_limit, prefill_attention.SCORES_BLOCK_BYTES)}
    print(f"device {mx.default_device()}; attention routed: {routed or 'no (not CUDA)'}; limits (GiB): "
          + ", ".join(f"{k} {v[0] / 1024**3:.1f}" for k, v in settings.items()), flush=True)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in settings}
    for turn in range(a.turns):
        for name in ("engine", "mlx") if turn % 2 == 0 else ("mlx", "engine"):
            limit, block = settings[name]
            mx.set_memory_limit(limit)
            prefill_attention.SCORES_BLOCK_BYTES = block
            release_unused()
            mx.reset_peak_memory()
            row: dict[str, Any] = {"turn": turn}
            try:
                prefill(model, a.rows, a.tokens, a.chunk, vocab)  # warm-up: kernels compile
                row["s"] = round(statistics.median(prefill(model, a.rows, a.tokens, a.chunk, vocab)
                                                   for _ in range(a.runs)), 4)
            except RuntimeError as exc:  # out of memory: what we came to see
                row["failed"] = str(exc)[:160]
            row["mlx_peak_gib"] = round(mx.get_peak_memory() / 1024**3, 2)
            if (card := cuda_memory()) is not None:
                row.update({k + "_gib": round(v / 1024**3, 2) for k, v in card.items()})
            results[name].append(row)
            print(name, json.dumps(row), flush=True)
    done = {n: [r["s"] for r in rs if "s" in r] for n, rs in results.items()}
    summary = {n: statistics.median(v) for n, v in done.items() if v}
    if len(summary) == 2:
        summary["engine_over_mlx"] = round(summary["engine"] / summary["mlx"], 3)
    print(json.dumps({"rows": a.rows, "tokens": a.tokens, "chunk": a.chunk, "median_s": summary}, indent=2))


if __name__ == "__main__":
    main()
