"""A batched decode step on MLX's CPU backend with MLX's masked attention against mlxd's split
attention (engine/gpu/cpu_attention.py), one process, alternated.

For each rows x context: the model called on one token per row with mlx-lm's BatchKVCache
holding `context` tokens (rows left-padded by a few tokens, as a batch whose rows started apart
is), median ms per step over `--steps` after a warm-up, MLX's attention and mlxd's in turn
`--rounds` times; then the same step's attention layer alone. The logits of both are compared.
Then a batched prefill: `--prefill` tokens for each of `--prefill-rows` rows (left-padded apart)
into a fresh cache, as a burst of new requests starts, with MLX's attention whole and split by
rows across the same CPU streams (`cpu_attention.by_rows`; the engine does not split prefill:
this measures why).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/cpu_attention.py --model SMOLLM2_DIR --rows 8,16,32 --contexts 300,600
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models import base
from mlx_lm.models.cache import BatchKVCache

from mlxd.engine.gpu import cpu_attention


def step_ms(model: Any, rows: int, context: int, steps: int) -> tuple[float, mx.array]:
    cache = [BatchKVCache([0] + [3] * (rows - 1)) for _ in model.layers]
    model(mx.full((rows, context), 5, dtype=mx.int32), cache=cache)
    mx.eval([c.state for c in cache])
    token = mx.full((rows, 1), 7, dtype=mx.int32)
    mx.eval(model(token, cache=cache))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = model(token, cache=cache)
        mx.eval(out)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), out


def layer_ms(rows: int, context: int, parts: int) -> tuple[float, float]:
    """One layer's attention (SmolLM2's 9/3 heads of 64) alone: MLX's, then mlxd's split."""
    q = mx.random.normal((rows, 9, 1, 64))
    k = mx.random.normal((rows, 3, context + 100, 64))[:, :, :context]
    mask = mx.ones((rows, 1, 1, context), dtype=mx.bool_)
    return (statistics.median(_times(lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask=mask))),
            statistics.median(_times(lambda: cpu_attention.split_attention(q, k, k, mask, 0.125, parts))))


def prefill_ms(model: Any, rows: int, tokens: int, repeats: int = 3) -> float:
    times = []
    for i in range(repeats + 1):
        cache = [BatchKVCache([(r * 5) % 17 for r in range(rows)]) for _ in model.layers]
        start = time.perf_counter()
        mx.eval(model(mx.full((rows, tokens), 5 + i, dtype=mx.int32), cache=cache))
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times[1:])


def split_prefill(n_cores: int) -> Any:
    """mlx-lm's attention with a batched prefill chunk's rows split across CPU streams."""

    def sdpa(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
             sinks: Any = None) -> mx.array:
        if isinstance(mask, mx.array) and mask.ndim == 4 and mask.shape[0] == queries.shape[0] > 1:
            return cpu_attention.by_rows(
                lambda q, k, v, m, sc, stream=None: mx.fast.scaled_dot_product_attention(q, k, v, scale=sc, mask=m,
                                                                                         stream=stream),
                queries, keys, values, mask, scale, cpu_attention.parts_for(queries.shape[0], keys.shape[2], n_cores))
        return base.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask,
                                                 sinks=sinks)

    return sdpa


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--rows", default="8,16,32")
    p.add_argument("--contexts", default="300,600")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prefill", type=int, default=176, help="prompt tokens a row in the batched prefill (0: none)")
    p.add_argument("--prefill-rows", type=int, default=8)
    a = p.parse_args()
    model = load(str(a.model))[0]
    modules = [sys.modules[n] for n in cpu_attention.install(model)]
    if not modules:
        raise SystemExit("mlxd's CPU attention did not install (MLXD_CPU_SPLIT_ATTENTION=0, or not a plain cache)")
    routed = modules[0].scaled_dot_product_attention
    n = cpu_attention.cores()
    print(f"model {a.model.name}, {n} cores, medians of {a.steps} steps (ms); MLX's attention / mlxd's split")
    for rows in (int(r) for r in a.rows.split(",")):
        for context in (int(c) for c in a.contexts.split(",")):
            mlx_ms, split_ms = [], []
            for _ in range(a.rounds):
                for m in modules:
                    m.scaled_dot_product_attention = base.scaled_dot_product_attention
                ms, want = step_ms(model, rows, context, a.steps)
                mlx_ms.append(ms)
                for m in modules:
                    m.scaled_dot_product_attention = routed
                ms, got = step_ms(model, rows, context, a.steps)
                split_ms.append(ms)
            diff = float(mx.max(mx.abs(got - want)).item())
            layer = layer_ms(rows, context, cpu_attention.parts_for(rows, context, n))
            ratio = statistics.median(mlx_ms) / statistics.median(split_ms)
            steps = " ".join(f"{x:.1f}" for x in mlx_ms) + " / " + " ".join(f"{x:.1f}" for x in split_ms)
            print(f"{rows:3d} rows, {context:5d} tokens: step {steps} = {ratio:.2f}x; one layer's attention "
                  f"(9/3 heads of 64) {layer[0]:.2f} / {layer[1]:.2f} ms; logits differ by {diff:.2g}")

    if a.prefill:
        runs: dict[str, list[float]] = {"MLX's": [], "split": []}
        for _ in range(a.rounds):
            for name, fn in (("MLX's", base.scaled_dot_product_attention), ("split", split_prefill(n))):
                for m in modules:
                    m.scaled_dot_product_attention = fn
                runs[name].append(prefill_ms(model, a.prefill_rows, a.prefill))
        ratio = statistics.median(runs["MLX's"]) / statistics.median(runs["split"])
        seen = " / ".join(" ".join(f"{x:.0f}" for x in v) for v in runs.values())
        print(f"prefill of {a.prefill_rows} rows x {a.prefill} tokens (MLX's attention / split by rows): {seen} ms = {ratio:.2f}x")


def _times(run: Any, repeats: int = 20) -> list[float]:
    mx.eval(run())
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(run())
        out.append((time.perf_counter() - start) * 1000)
    return out


if __name__ == "__main__":
    main()
