"""One CUDA kernel for a decode step's per-row LoRA updates (NVIDIA GPUs; adapter_bank.py).

Rows under different adapters in one batched step each add their own low-rank update to a
layer's output: `y[i] + (x[i] @ A[slot[i]]) @ B[slot[i]]`. Done with MLX ops that is two
gather_mm, a cast and an add: four kernel launches for every adapted layer, each ~10 µs on
MLX's CUDA backend whatever its size (benchmarks/lora_step_probe.py), which at decode, where
the updates themselves are tiny, cost more than the updates. This kernel does the whole of it
in one launch: a block per (row, 256 outputs) first reduces the row's `x @ A` (R values, each
block again: A is a few KB, read from L2), then writes its 256 outputs `y + h @ B`, in float.

Used for decode steps (one token a row) with ranks up to MAX_RANK and no DoRA gain; prefill
chunks and everything else keep the MLX ops, whose matmuls are the faster there. On Metal
and CPU it is never used (`usable()`).
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

THREADS = 256
MAX_RANK = 16  # above it the redundant A reads of every block cost more than the launches saved

_SOURCE = """
    constexpr int WARPS = 256 / 32;
    __shared__ float partial[WARPS][R];
    __shared__ float h[R];
    const int row = blockIdx.y;
    const int tid = threadIdx.x;
    const int slot = static_cast<int>(slots[row]);
    const auto* xr = x + static_cast<size_t>(row) * DIN;
    const auto* a = A + static_cast<size_t>(slot) * DIN * R;
    float acc[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (int i = tid; i < DIN; i += 256) {
        const float xv = static_cast<float>(xr[i]);
        const auto* ai = a + static_cast<size_t>(i) * R;
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[r] += xv * static_cast<float>(ai[r]);
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        float v = acc[r];
        for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
        if ((tid & 31) == 0) partial[tid >> 5][r] = v;
    }
    __syncthreads();
    for (int r = tid; r < R; r += 256) {
        float v = 0.0f;
        for (int w = 0; w < WARPS; ++w) v += partial[w][r];
        h[r] = v;
    }
    __syncthreads();
    const int j = blockIdx.x * 256 + tid;
    if (j < DOUT) {
        const auto* b = B + static_cast<size_t>(slot) * R * DOUT + j;
        float d = 0.0f;
        #pragma unroll
        for (int r = 0; r < R; ++r) d += h[r] * static_cast<float>(b[static_cast<size_t>(r) * DOUT]);
        const size_t at = static_cast<size_t>(row) * DOUT + j;
        out[at] = static_cast<OutT>(static_cast<float>(y[at]) + d);
    }
"""


@functools.cache
def usable() -> bool:
    """Whether this process runs MLX on an NVIDIA GPU (the kernel is CUDA)."""
    try:
        return bool(mx.cuda.is_available()) and mx.default_device().type == mx.gpu
    except AttributeError:  # an MLX without its CUDA module
        return False


@functools.cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(name="mlxd_lora_rows", input_names=["x", "y", "A", "B", "slots"],
                               output_names=["out"], source=_SOURCE)


def fits(x: mx.array, a: mx.array) -> bool:
    """Whether the kernel takes this step: one token a row, a stacked A of a small rank."""
    return x.ndim == 3 and x.shape[1] == 1 and a.ndim == 3 and a.shape[2] <= MAX_RANK


def launch(x: mx.array, y: mx.array, a: mx.array, b: mx.array, slots: mx.array) -> mx.array:
    """`y + (x[i] @ a[slots[i]]) @ b[slots[i]]` for every row i, in y's dtype (x: (N, 1, in),
    y: (N, 1, out), a: (S, in, R), b: (S, R, out), slots: (N,) uint32)."""
    n, d_in, d_out, rank = x.shape[0], x.shape[2], y.shape[-1], a.shape[2]
    blocks = (d_out + THREADS - 1) // THREADS
    (out,) = _kernel()(
        inputs=[x, y, a, b, slots],
        template=[("OutT", y.dtype), ("R", rank), ("DIN", d_in), ("DOUT", d_out)],
        grid=(blocks * THREADS, n, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[y.shape], output_dtypes=[y.dtype],
    )
    return out


@functools.cache
def _compiled() -> Any:
    # Traced once per shape: a step then replays the kernel node, without building the
    # kernel's source string and its template arguments again on every call.
    return mx.compile(launch)


def rows_update(x: mx.array, y: mx.array, a: mx.array, b: mx.array, slots: mx.array) -> mx.array:
    """`launch`, compiled."""
    return _compiled()(x, y, a, b, slots)
