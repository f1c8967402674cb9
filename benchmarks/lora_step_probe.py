"""What a LoRA update costs a decode step: 112 chained linear layers (a 1B model's 16 layers x 7),
bf16, 2048 wide, rank 8, each way of adding a per-row update timed against the plain layers.

On MLX's CUDA backend each op costs about 10 us at these sizes, whatever its work. So an update
of two small matmuls and an add costs about what the layer itself does. The H200's numbers are
in docs/benchmarks.md ("Adapters").

  python benchmarks/lora_step_probe.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx

D = OUT = 2048
R = 8
LAYERS = 112
SLOTS = 9
BF16 = mx.bfloat16


def rand(*shape: int) -> mx.array:
    return (mx.random.normal(shape) * 0.02).astype(BF16)


W, a, b = rand(OUT, D), rand(D, R), rand(R, OUT)
A, B = rand(SLOTS, D, R), rand(SLOTS, R, OUT)


def variants(rows: int) -> dict[str, Callable[[mx.array], mx.array]]:
    idx = mx.array(list(range(1, rows + 1)) if rows > 1 else [3], dtype=mx.uint32)
    return {
        "base": lambda x: x @ W.T,
        "lora": lambda x: x @ W.T + (x @ a) @ b,
        "addmm": lambda x: mx.addmm(x @ W.T, x @ a, b),
        "gather_mm": lambda x: x @ W.T + mx.gather_mm(mx.gather_mm(x, A, rhs_indices=idx), B, rhs_indices=idx),
        "take": lambda x: x @ W.T + (x @ A[idx]) @ B[idx],
    }


def main() -> None:
    for rows in (1, 8):
        x0 = mx.random.normal((rows, 1, D)).astype(BF16)
        for name, layer in variants(rows).items():
            def step(layer: Callable[[mx.array], mx.array] = layer, x0: mx.array = x0) -> None:
                x = x0
                for _ in range(LAYERS):
                    x = layer(x) * 0.5
                mx.eval(x)

            try:
                step()
            except RuntimeError as exc:  # the CPU build's gather_mm takes float32 only
                print(f"rows {rows} {name:10s} n/a: {exc}")
                continue
            for _ in range(4):
                step()
            n, t0 = 30, time.perf_counter()
            for _ in range(n):
                step()
            print(f"rows {rows} {name:10s} {(time.perf_counter() - t0) / n * 1000:.3f} ms / {LAYERS} layers")


if __name__ == "__main__":
    main()
