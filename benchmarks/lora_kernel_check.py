"""The one-launch per-row LoRA kernel (mlxd/engine/models/lora_kernel.py) on an NVIDIA GPU:
its output against the MLX ops it replaces, and the time of one adapted layer's update both
ways; then the same for groups of layers that read one input (q, k, v; gate, up), in one launch.

  python benchmarks/lora_kernel_check.py          # on the device (MLX's CUDA backend)

For each shape (a 1B and an 8B model's projections), dtype and rank: the largest difference
from `y + gather_mm(gather_mm(x, A, slots), B, slots)` (in float32 reference), then the time of
100 chained updates each way, after a warm-up, as a ratio.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxd.engine.models import lora_kernel

SHAPES = [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048), (4096, 4096), (4096, 14336), (14336, 4096)]


def reference(x: mx.array, y: mx.array, a: mx.array, b: mx.array, slots: mx.array) -> mx.array:
    delta = mx.gather_mm(mx.gather_mm(x, a, rhs_indices=slots), b, rhs_indices=slots)
    return y + delta.astype(y.dtype)


def timed(fn, x, y, a, b, slots, n: int = 100) -> float:  # type: ignore[no-untyped-def]
    out = y
    for _ in range(3):
        mx.eval(fn(x, out, a, b, slots))
    start = time.perf_counter()
    out = y
    for _ in range(n):
        out = fn(x, out, a, b, slots)
    mx.eval(out)
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    assert lora_kernel.usable(), "needs MLX on an NVIDIA GPU"
    rows = []
    for dtype in (mx.bfloat16,):
        for rank in (8,):
            for d_in, d_out in SHAPES:
                mx.random.seed(0)
                n, slots_n = 8, 9
                x = mx.random.normal((n, 1, d_in)).astype(dtype)
                y = mx.random.normal((n, 1, d_out)).astype(dtype)
                a = (mx.random.normal((slots_n, d_in, rank)) * 0.02).astype(dtype)
                b = (mx.random.normal((slots_n, rank, d_out)) * 0.02).astype(dtype)
                slots = mx.array([0, 3, 1, 8, 2, 2, 5, 7], dtype=mx.uint32)
                got = lora_kernel.rows_update(x, y, a, b, slots).astype(mx.float32)
                want = reference(x.astype(mx.float32), y.astype(mx.float32), a.astype(mx.float32),
                                 b.astype(mx.float32), slots)
                err = mx.max(mx.abs(got - want)).item()
                scale = mx.max(mx.abs(want)).item()
                kernel_us = timed(lora_kernel.rows_update, x, y, a, b, slots)
                ops_us = timed(reference, x, y, a, b, slots)
                rows.append({"dtype": str(dtype), "rank": rank, "in": d_in, "out": d_out, "max_err": err,
                             "max_abs": scale, "kernel_us": round(kernel_us, 1), "ops_us": round(ops_us, 1)})
                print(json.dumps(rows[-1]), flush=True)
                tolerance = 0.02 if dtype == mx.bfloat16 else 0.005
                assert err <= tolerance * max(1.0, scale), rows[-1]
    groups = {"1B q,k,v": (2048, (2048, 512, 512)), "1B gate,up": (2048, (8192, 8192)),
              "8B q,k,v": (4096, (4096, 1024, 1024))}
    for label, (d_in, outs) in groups.items():
        mx.random.seed(1)
        n, slots_n, rank, dtype = 8, 9, 8, mx.bfloat16
        x = mx.random.normal((n, 1, d_in)).astype(dtype)
        slots = mx.array([0, 3, 1, 8, 2, 2, 5, 7], dtype=mx.uint32)
        layers = [(mx.random.normal((n, 1, d)).astype(dtype), (mx.random.normal((slots_n, d_in, rank)) * 0.02).astype(dtype),
                   (mx.random.normal((slots_n, rank, d)) * 0.02).astype(dtype)) for d in outs]
        got = lora_kernel.rows_update_group(x, slots, layers)
        errs = []
        for out, (y, a, b) in zip(got, layers, strict=True):
            want = reference(x.astype(mx.float32), y.astype(mx.float32), a.astype(mx.float32), b.astype(mx.float32), slots)
            errs.append(mx.max(mx.abs(out.astype(mx.float32) - want)).item())

        rest = layers[1:]

        def grouped(x, y, a, b, slots, rest=rest):  # type: ignore[no-untyped-def]
            return lora_kernel.rows_update_group(x, slots, [(y, a, b), *rest])[0]

        def each(x, y, a, b, slots, rest=rest):  # type: ignore[no-untyped-def]
            # Every layer's update, as the MLX ops make them; the others' outputs feed the chain
            # (times zero) so that lazy evaluation cannot skip them.
            outs_ = [reference(x, y, a, b, slots), *(reference(x, y2, a2, b2, slots) for y2, a2, b2 in rest)]
            return outs_[0] + 0 * sum(o.sum() for o in outs_[1:])

        row = {"group": label, "max_err": max(errs), "one_launch_us": round(timed(grouped, x, *layers[0], slots), 1),
               "ops_us": round(timed(each, x, *layers[0], slots), 1)}
        print(json.dumps(row), flush=True)
        assert max(errs) <= 0.02 * 5, row
    print("all shapes match")


if __name__ == "__main__":
    main()
