"""Which attention a prefill chunk runs on MLX's CUDA backend: cuDNN's or MLX's unfused one.

cuDNN's fused attention is what makes long prompts fast: on an H200 a 1B model prefilled a
24,000-token prompt in 0.27 s with it and 1.3 s with MLX's unfused attention (which writes and
reads the whole query x key score matrix), the gap growing with the context
(docs/benchmarks.md, "Long prompts"). But cuDNN builds a graph for every new attention shape
(query length, key length, strides: ~80-100 ms each), keeps 256 of them, and MLX throws once
it has missed 512 times in a process's life; a server meets a new prompt length with nearly
every request. So the engine runs MLX with cuDNN's attention on, and routes each prefill
chunk here:

- a full chunk of one row at an aligned position (query length the engine's prefill chunk,
  key length a multiple of it, K and V made contiguous so their strides follow the shape):
  cuDNN. Such shapes are few (one per chunk of the window), each built once;
- a prompt's last partial chunk of one row after aligned ones (a causal mask, the keys
  before it a multiple of the chunk): its queries and keys padded at the end to a multiple
  of BUCKET with zeros, the output cut back. Under a causal mask a real query never sees
  the padded keys (they come after it), so the result is exact, and the shapes are again
  few (BUCKET steps of query length, one set per aligned offset), so each graph is built
  once in an engine's life. Only when its unfused attention would cost a few milliseconds
  (CUDNN_BUCKET_MIN_WORK): a short prompt's one chunk stays unfused;
- a chunk whose unfused attention would cost more than building a graph (query x key x
  heads x head size of CUDNN_MIN_WORK or more, calibrated on the H200's 1B model): cuDNN,
  a graph for this shape alone;
- every other chunk (short prompts, small bursts, a chunk after a cached prefix at an
  unaligned position over a short context): MLX's unfused attention, computed here as
  MLX's own fallback computes it.

Decode steps (one query a row) are not routed here: MLX's vector kernel or cuDNN's decode
attention serve a plain cache, mlxd's kernel a batch (decode_attention.py).
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

# q_len x k_len x heads x head_dim from which cuDNN's graph (~100 ms once) costs less than
# MLX's unfused attention over the model's layers (1B on the H200: about 4.6 ms per million
# query x key pairs, 2048 = 32 heads x 64, over 16 layers).
CUDNN_MIN_WORK = 4 * 10**10
# A padded last chunk's shape recurs (BUCKET steps): worth cuDNN from about 2.4 million
# query x key pairs at 2048 (about 11 ms unfused over the 1B model's layers).
CUDNN_BUCKET_MIN_WORK = 5 * 10**9
BUCKET = 256
CUDNN_DTYPES = (mx.float16, mx.bfloat16)
aligned_chunk = 2048  # the engine's solo prefill chunk (set at load): full aligned chunks go to cuDNN
# The most attention scores one operation of the unfused attention makes. MLX queues a forward
# pass ahead of the GPU and stops queueing only once its memory limit is passed, so a pass may
# hold that limit plus one operation's output. Eight rows of a 4,574-token prompt prefilled
# together by an 8B model (32 heads, 2048-query chunks) made scores of 4.5 GiB an operation,
# and an H100 80GB ran out of memory (docs/benchmarks.md, issue 29); a group of rows at a time
# keeps each operation within this.
SCORES_BLOCK_BYTES = 1024**3


def cudnn_on(environ: Any = os.environ) -> bool:
    """Whether MLX may run cuDNN's attention here (CUDA, and not turned off in the environment)."""
    return environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1") != "0" and bool(mx.cuda.is_available())


_cudnn = cudnn_on()


def eligible(queries: mx.array, keys: Any, values: Any, sinks: Any) -> bool:
    """Whether MLX would run cuDNN's attention for this prefill chunk at all."""
    return (_cudnn and sinks is None and isinstance(keys, mx.array) and queries.shape[2] > 1
            and queries.dtype in CUDNN_DTYPES and queries.shape[-1] % 8 == 0 and queries.shape[-1] <= 128
            and values.shape[-1] % 8 == 0 and values.shape[-1] <= 128 and queries.shape[2] <= keys.shape[2])


def plan(queries: mx.array, keys: mx.array, mask: Any) -> tuple[str, int]:
    """How a prefill chunk runs: ("aligned" | "padded" | "graph" | "unfused", padding).

    aligned: cuDNN, K and V made contiguous (a full chunk at an aligned position); padded:
    cuDNN over queries and keys padded at the end by `padding` (a last partial chunk after
    aligned ones); graph: cuDNN at this shape alone; unfused: MLX's unfused attention.
    """
    B, H, q_len, D = queries.shape
    k_len = keys.shape[2]
    if B == 1 and (mask is None or isinstance(mask, str)) and (k_len - q_len) % aligned_chunk == 0:
        if q_len == aligned_chunk:
            return "aligned", 0
        pad = -q_len % BUCKET
        if mask == "causal" and q_len < aligned_chunk and (q_len + pad) * (k_len + pad) * H * D >= CUDNN_BUCKET_MIN_WORK:
            return "padded", pad
    return ("graph", 0) if q_len * k_len * H * D >= CUDNN_MIN_WORK else ("unfused", 0)


def row_groups(rows: int, heads: int, q_len: int, k_len: int, itemsize: int,
               block_bytes: int | None = None) -> list[tuple[int, int]]:
    """The rows of a batched chunk's unfused attention, in groups whose scores (heads x queries x
    keys each) stay within `block_bytes` (SCORES_BLOCK_BYTES), one row at least: [(start, stop)]."""
    per_row = heads * q_len * k_len * itemsize
    size = max(1, (SCORES_BLOCK_BYTES if block_bytes is None else block_bytes) // max(1, per_row))
    return [(start, min(rows, start + size)) for start in range(0, rows, size)]


def unfused(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """Attention as MLX's fallback computes it: scores in full, masked, softmax, then values; a
    group of rows at a time where the whole batch's scores would outgrow SCORES_BLOCK_BYTES."""
    B, H, q_len = queries.shape[:3]
    additive = isinstance(mask, mx.array) and mask.dtype != mx.bool_  # scores take its dtype if wider
    groups = row_groups(B, H, q_len, keys.shape[2], max(queries.dtype.size, mask.dtype.size if additive else 0))
    if len(groups) == 1:
        return _unfused(queries, keys, values, scale, mask)
    def rows_of(mask: Any, start: int, stop: int) -> Any:  # a mask broadcast over rows is everyone's
        return mask[start:stop] if isinstance(mask, mx.array) and mask.ndim == 4 and mask.shape[0] == B else mask
    return mx.concatenate([_unfused(queries[a:b], keys[a:b], values[a:b], scale, rows_of(mask, a, b))
                           for a, b in groups], axis=0)


def _unfused(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    B, H, q_len, D = queries.shape
    kv_heads, k_len = keys.shape[1], keys.shape[2]
    repeats = H // kv_heads
    q = queries * scale
    if repeats > 1:
        q = q.reshape(B, kv_heads, repeats, q_len, D)
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
    scores = q @ keys.swapaxes(-1, -2)
    if isinstance(mask, str):  # "causal": the queries are the last q_len positions
        rows = mx.arange(k_len - q_len, k_len)[:, None]
        mask = rows >= mx.arange(k_len)[None]
    if mask is not None:
        if repeats > 1 and mask.ndim >= 3:  # per head, or one for all heads: to (.., kv heads, repeats, q, k)
            if mask.shape[-3] == 1:
                mask = mx.expand_dims(mask, -3)
            else:
                mask = mask.reshape(*mask.shape[:-3], kv_heads, repeats, *mask.shape[-2:])
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = scores @ values
    return out.reshape(B, H, q_len, -1) if repeats > 1 else out


def route(original: Any, queries: mx.array, keys: Any, values: Any, cache: Any, scale: float, mask: Any,
          sinks: Any) -> mx.array:
    """A prefill chunk's attention: cuDNN's through mlx-lm's function, or the unfused one."""
    if not eligible(queries, keys, values, sinks):
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    how, pad = plan(queries, keys, mask)
    if how == "unfused":
        return unfused(queries, keys, values, scale, mask)
    if how == "aligned":
        keys, values = mx.contiguous(keys), mx.contiguous(values)
    elif how == "padded":
        q_len, at_end = queries.shape[2], [(0, 0), (0, 0), (0, pad), (0, 0)]
        queries, keys, values = mx.pad(queries, at_end), mx.pad(keys, at_end), mx.pad(values, at_end)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)[:, :, :q_len]
    return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
