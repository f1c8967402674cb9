"""Where a batched decode step's time goes: the same 8 rows decoded three ways, one process.

  * plain: the model called on (rows, 1) tokens with mlx-lm's ordinary KVCache (rows of one
    length, so attention needs no mask and MLX's fused vector attention runs);
  * batch cache: the same call with BatchKVCache (mlx-lm's continuous-batching cache): it
    always passes an array mask, so MLX's CUDA backend falls back to unfused attention;
  * BatchGenerator: mlx-lm's whole batched step (sampling, bookkeeping, one step ahead), and
    again with a logit_bias on every row (as benchmarks/batching.py sends, to keep EOS away:
    mlx-lm applies logits processors row by row);
  * on CUDA, the batch cache and BatchGenerator again with mlxd's fused decode attention
    (engine/gpu/decode_attention.py), which takes each row's start instead of the mask.

For the batch cache it also reports how long building one step's graph takes on the host
(the model call without evaluating it): when that nears the step time, the step is bound by
Python and graph construction, not by the GPU.

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
    from mlx_lm.sample_utils import make_logits_processors

    from mlxd.engine.gpu import decode_attention
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

    build_ms: list[float] = []

    def model_steps(cache: list) -> float:  # type: ignore[type-arg]
        model(prompts, cache=cache)
        tok = mx.zeros((a.rows, 1), dtype=mx.int32)

        def step() -> None:
            nonlocal tok
            t = time.perf_counter()
            logits = model(tok, cache=cache)
            tok = mx.argmax(logits[:, -1:, :], axis=-1).astype(mx.int32)
            build_ms.append((time.perf_counter() - t) * 1000)
            mx.eval(tok)

        build_ms.clear()
        return timed(step)

    def generator_steps(bias: bool = False) -> float:
        gen = BatchGenerator(model, completion_batch_size=a.rows, prefill_batch_size=min(a.rows, 8))
        processors = [make_logits_processors(logit_bias={2: -100.0}) for _ in range(a.rows)] if bias else None
        gen.insert(prompts.tolist(), max_tokens=[10_000] * a.rows, logits_processors=processors)
        while not gen.next_generated():
            pass
        ms = timed(gen.next_generated)
        gen.close()
        return ms

    plain = model_steps(make_prompt_cache(model))
    # Staggered starts, as continuous batching leaves them (rows joined at different times).
    pads = [(r * 37) % 64 for r in range(a.rows)]
    batch_cache = model_steps([BatchKVCache(pads) for _ in model.layers])
    build = statistics.median(build_ms)
    generator = generator_steps()
    line = (f"{a.model}: {a.rows} rows, {flattened} flattened layers; ms per decode step (median of {a.steps}): "
            f"plain KVCache {plain:.2f}, BatchKVCache {batch_cache:.2f} (graph built in {build:.2f}), "
            f"BatchGenerator {generator:.2f}, with a logit_bias on each row {generator_steps(bias=True):.2f}")
    if decode_attention.enabled() and decode_attention.install(model):
        fused_cache = model_steps([BatchKVCache(pads) for _ in model.layers])
        line += (f"; with the fused decode attention: BatchKVCache {fused_cache:.2f} "
                 f"(graph built in {statistics.median(build_ms):.2f}), BatchGenerator {generator_steps():.2f}")
    print(line, flush=True)


if __name__ == "__main__":
    main()
