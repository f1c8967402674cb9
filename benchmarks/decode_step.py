"""Where a batched decode step's time goes: the same 8 rows decoded three ways, one process.

  * plain: the model called on (rows, 1) tokens with mlx-lm's ordinary KVCache (rows of one
    length, so attention needs no mask and MLX's fused vector attention runs);
  * batch cache: the same call with BatchKVCache (mlx-lm's continuous-batching cache): it
    always passes an array mask, so MLX's CUDA backend falls back to unfused attention;
  * BatchGenerator: mlx-lm's whole batched step (sampling, bookkeeping, one step ahead).

Each: median ms per step over `--steps` steps after a warm-up. Quantized models run with
mlxd's flattened rows (engine/gpu/flat_rows.py) where they win, as the engine runs them.

  python benchmarks/decode_step.py /tmp/models/l8q --rows 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--steps", type=int, default=60)
    a = p.parse_args()

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    from mlxd.engine.gpu.flat_rows import flatten_quantized_rows, wins_here

    model, _ = load(a.model)
    flattened = flatten_quantized_rows(model) if wins_here() else 0
    vocab = model.args.vocab_size
    prompts = mx.array([[(i * 31 + r * 7) % (vocab - 5) + 2 for i in range(a.prompt)] for r in range(a.rows)])

    def timed(step) -> float:  # type: ignore[no-untyped-def]
        for _ in range(5):
            step()
        times = []
        for _ in range(a.steps):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1000

    def model_steps(cache: list) -> float:  # type: ignore[type-arg]
        model(prompts, cache=cache)
        tok = mx.zeros((a.rows, 1), dtype=mx.int32)

        def step() -> None:
            nonlocal tok
            logits = model(tok, cache=cache)
            tok = mx.argmax(logits[:, -1:, :], axis=-1).astype(mx.int32)
            mx.eval(tok)

        return timed(step)

    plain = model_steps(make_prompt_cache(model))
    batch_cache = model_steps([BatchKVCache([0] * a.rows) for _ in model.layers])
    gen = BatchGenerator(model, completion_batch_size=a.rows, prefill_batch_size=min(a.rows, 8))
    gen.insert(prompts.tolist(), max_tokens=[10_000] * a.rows)
    while not gen.next_generated():
        pass
    generator = timed(gen.next_generated)
    print(f"{a.model}: {a.rows} rows, {flattened} flattened layers; ms per decode step (median of {a.steps}): "
          f"plain KVCache {plain:.2f}, BatchKVCache {batch_cache:.2f}, BatchGenerator {generator:.2f}")


if __name__ == "__main__":
    main()
