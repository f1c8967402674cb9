"""What a batch's verification pass costs by its width, and what rolling each row's KV back adds.

A batch step with drafts feeds every row B x (w + 1) positions; rows that keep different numbers
of drafts must each lose their own count of KV entries. mlx-lm's batch cache does that by rolling
every row's whole buffer (`prepare(right_padding)` + `finalize`); mlxd masks the refused entries
as holes instead (mlxd/engine/spec/holes.py). This times, on mlx-lm's plain batch cache:
a pass of 1, 2, 3 and 5 positions a row, and a 5-position pass followed by the roll.

  python benchmarks/batch_verify_probe.py                      # SmolLM2-135M-Instruct, 8 rows of 700 tokens
  python benchmarks/batch_verify_probe.py --model DIR --rows 8 --context 2000
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from batching import default_model
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.utils import load


def best_ms(fn: Any, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--context", type=int, default=700)
    a = p.parse_args()
    path = a.model or default_model()
    model, _ = load(str(path))
    rows = a.rows
    cache = [BatchKVCache([0] * rows) for _ in model.layers]
    model(mx.random.randint(0, 1000, (rows, a.context)), cache=cache)
    mx.eval([c.state for c in cache])

    def step(width: int) -> Any:
        def run() -> None:
            mx.eval(model(mx.zeros((rows, width), dtype=mx.int32), cache=cache))
            for c in cache:
                c.trim(width)
        return run

    plain = best_ms(step(1))
    print(f"{path.name}: {rows} rows of {a.context} tokens")
    for width in (1, 2, 3, 5):
        ms = best_ms(step(width))
        print(f"  a pass of {width} position(s) a row: {ms:.1f} ms ({ms / plain:.2f} plain steps)")

    def rolled() -> None:
        mx.eval(model(mx.zeros((rows, 5), dtype=mx.int32), cache=cache))
        for c in cache:
            c.trim(1)
            c.prepare(right_padding=[i % 4 for i in range(rows)])
            c.finalize()
        mx.eval([c.state for c in cache])

    print(f"  a pass of 5 and each row's KV rolled back by its own count: {best_ms(rolled):.1f} ms")


if __name__ == "__main__":
    main()
