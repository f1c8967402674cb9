"""Batched decode attention on MLX's CPU backend, on every core.

mlx-lm's `BatchKVCache` gives a batched decode step's attention an array mask (where each
left-padded row's keys start). MLX's CPU backend runs attention with a mask unfused and on one
thread, while the step's matmuls with the weights run on OpenBLAS's threads: at 32 rows and 300
tokens of context it was about half of SmolLM2-135M's step on the 2-core test machine.
`split_attention` computes the same thing as two matmuls and a softmax, the query heads that
share a key head folded into one matrix, and splits the rows into parts that run on CPU streams
of their own (MLX runs each stream on its own thread), one per core; the parts join in the
step's stream (docs/benchmarks.md, "Eleventh session").

`install(model)` routes the loaded model's attention through it (the way decode_attention.py
does on CUDA): only batched single-token steps with a boolean mask of one row each, checked
against MLX's own attention for each head layout and dtype on first use; everything else goes
to mlx-lm's function: the serial lane's plain cache, and prefill chunks (MLX's attention split
the same way took 1.6x less time alone for 8 rows of 176 tokens, but no less inside the model's
prefill, where OpenBLAS's threads hold the cores: docs/benchmarks.md).
`MLXD_CPU_SPLIT_ATTENTION=0` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxd.engine.gpu import decode_attention

ENV = "MLXD_CPU_SPLIT_ATTENTION"
MOST_PARTS = 8
KEYS_A_PART = 800
TOLERANCE = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 3e-2}

_streams: list[Any] = []
_verdicts: dict[tuple[int, int, int, Any], bool] = {}


def enabled(environ: dict[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(ENV, "1") != "0"


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call on macOS
        return os.cpu_count() or 1


def parts_for(rows: int, keys: int, n_cores: int) -> int:
    """How many parts a step of `rows` rows over `keys` keys splits into: one per core, at most
    one per row, and one per KEYS_A_PART rows x keys (below that a stream's hand-over costs more
    than the part: 16 rows x 50 keys ran in 0.39 ms in one part, 0.48 in two)."""
    return max(1, min(rows, n_cores, MOST_PARTS, rows * keys // KEYS_A_PART))


def extra_streams(n: int) -> list[Any]:
    """`n` CPU streams besides the step's own, made once (each is a thread of MLX's)."""
    while len(_streams) < n:
        _streams.append(mx.new_stream(mx.cpu))
    return _streams[:n]


def attention(q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float, stream: Any = None) -> mx.array:
    """Single-query attention of B rows: q (B, H, 1, D), k and v (B, Hk, S, D), mask (B, 1, 1, S)
    boolean (True: attend). The H / Hk query heads of a key head are one (rep, D) matrix."""
    B, H, _, D = q.shape
    Hk = k.shape[1]
    qf = (q * scale).reshape(B, Hk, H // Hk, D)
    scores = mx.matmul(qf, k.swapaxes(-1, -2), stream=stream)
    scores = mx.where(mask.reshape(B, 1, 1, -1), scores, mx.finfo(scores.dtype).min, stream=stream)
    weights = mx.softmax(scores, axis=-1, precise=True, stream=stream)
    return mx.matmul(weights, v, stream=stream).reshape(B, H, 1, D)


def by_rows(fn: Callable[..., mx.array], q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float,
            parts: int) -> mx.array:
    """`fn` on the rows in `parts` parts: the first in the current stream, each other one in a CPU
    stream of its own, joined in the current stream."""
    B = q.shape[0]
    if parts <= 1:
        return fn(q, k, v, mask, scale)
    bounds = [B * i // parts for i in range(parts + 1)]
    streams = [None, *extra_streams(parts - 1)]
    outs = [fn(q[a:b], k[a:b], v[a:b], mask[a:b], scale, stream=s)
            for a, b, s in zip(bounds[:-1], bounds[1:], streams, strict=True)]
    return mx.concatenate(outs, axis=0)


def split_attention(q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float, parts: int) -> mx.array:
    """A batched decode step's attention (`attention`), its rows in `parts` parts."""
    return by_rows(attention, q, k, v, mask, scale, parts)


def check(heads: int, kv_heads: int, dim: int, dtype: Any) -> bool:
    """Whether split_attention matches MLX's masked attention for these sizes (once per sizes)."""

    def max_error() -> float:
        kq, kk, kv = mx.random.split(mx.random.key(11), 3)
        B, S, alloc = 5, 37, 64
        q = mx.random.normal((B, heads, 1, dim), key=kq).astype(dtype)
        k = mx.random.normal((B, kv_heads, alloc, dim), key=kk).astype(dtype)[:, :, :S, :]
        v = mx.random.normal((B, kv_heads, alloc, dim), key=kv).astype(dtype)[:, :, :S, :]
        starts = mx.array([0, 3, 9, 20, S - 1])
        mask = (mx.arange(S)[None, :] >= starts[:, None]).reshape(B, 1, 1, S)
        scale = dim**-0.5
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask).astype(mx.float32)
        return max(float(mx.max(mx.abs(split_attention(q, k, v, mask, scale, n).astype(mx.float32) - want)).item())  # type: ignore[arg-type]
                   for n in (1, 2, 3))

    return decode_attention.verdict(_verdicts, (heads, kv_heads, dim, dtype), max_error, TOLERANCE.get(dtype, 1e-4),
                                    "CPU split attention")


def suits(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, mask: Any, sinks: Any) -> bool:
    """Whether this call is a batched single-token step with a boolean mask of one row each."""
    return (decode_attention.batched_decode_step(queries, keys, values, cache, mask, sinks)
            and queries.dtype in TOLERANCE and check(queries.shape[1], keys.shape[1], queries.shape[3], queries.dtype))


def wrap(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """mlx-lm's scaled_dot_product_attention, with batched decode steps split across the cores."""
    n_cores = cores()

    def cpu_sdpa(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                 mask: Any, sinks: Any = None) -> mx.array:
        if suits(queries, keys, values, cache, mask, sinks):
            parts = parts_for(queries.shape[0], keys.shape[2], n_cores)
            return split_attention(queries, keys, values, mask, scale, parts)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    return cpu_sdpa


def install(model: Any) -> list[str]:
    """Route the model's attention through cpu_sdpa; the mlx-lm modules changed (none when
    turned off by the environment)."""
    if not enabled():
        return []
    return decode_attention.install(model, wrap)
