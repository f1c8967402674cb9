"""Which parts of a batched decode step grow with the context, in one process: the model on
mlx-lm's BatchKVCache. (benchmarks/decode_step.py compares cache kinds and mlx-lm's whole
generator step at one context; this one splits a step by context and by row removal.)

For each row count: the step with `--context` tokens already in the cache against the step
with one token (the difference is attention over the context), one layer's attention alone
(MLX's scaled_dot_product_attention on a slice of the cache's buffer, as mlx-lm calls it), the
copy of that layer's keys and values, and the step right after the first row leaves the batch
(mlx-lm's filter gathers the remaining rows' KV into new arrays), all medians.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/decode_step_parts.py --model SMOLLM2_DIR --rows 8,32 --context 300
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache


def timed(run: Callable[[], Any], repeats: int) -> float:
    """Median milliseconds of `run()` evaluated, after one untimed call."""
    mx.eval(run())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(run())
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def filled_cache(model: Any, rows: int, context: int, left_padding: list[int]) -> list[BatchKVCache]:
    cache = [BatchKVCache(left_padding) for _ in model.layers]
    model(mx.full((rows, context), 5, dtype=mx.int32), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def measure(model: Any, rows: int, context: int, repeats: int) -> dict[str, float]:
    token = mx.full((rows, 1), 7, dtype=mx.int32)
    full = filled_cache(model, rows, context, [0] * rows)
    short = filled_cache(model, rows, 1, [0] * rows)
    out = {"step": timed(lambda: model(token, cache=full), repeats),
           "step_1_token": timed(lambda: model(token, cache=short), repeats)}
    args = model.args
    heads = args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    keys, values = full[0].keys_and_values()
    query = mx.random.normal((rows, heads, 1, head_dim)).astype(keys.dtype)
    scale = head_dim**-0.5
    out["layer_attention"] = timed(lambda: mx.fast.scaled_dot_product_attention(query, keys, values, scale=scale),
                                   repeats)
    out["layer_kv_copy"] = timed(lambda: [mx.contiguous(keys), mx.contiguous(values)], repeats)
    # The first row started a few tokens earlier (the others are left-padded): when it leaves,
    # mlx-lm gathers the rest and drops the padding they all share.
    padded = filled_cache(model, rows, context, [0] + [3] * (rows - 1))
    keep = list(range(1, rows))
    start = time.perf_counter()
    for c in padded:
        c.filter(keep)
    mx.eval(model(token[1:], cache=padded))
    out["step_after_filter"] = (time.perf_counter() - start) * 1000
    out["step_after_that"] = timed(lambda: model(token[1:], cache=padded), repeats)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="MLX model dir")
    p.add_argument("--rows", default="8,32", help="batch rows, comma-separated")
    p.add_argument("--context", type=int, default=300, help="tokens in the cache before the step")
    p.add_argument("--repeats", type=int, default=8)
    args = p.parse_args()
    model = load(str(args.model))[0]
    print(f"model {args.model}, context {args.context} tokens, medians of {args.repeats} (ms)")
    for rows in (int(r) for r in args.rows.split(",")):
        parts = measure(model, rows, args.context, args.repeats)
        print(f"{rows} rows: " + ", ".join(f"{name} {ms:.1f}" for name, ms in parts.items()))


if __name__ == "__main__":
    main()
