"""One CUDA kernel for a decode step's per-row LoRA updates (NVIDIA GPUs; adapter_bank.py).

Rows under different adapters in one batched step each add their own low-rank update to a
layer's output: `y[i] + (x[i] @ A[slot[i]]) @ B[slot[i]]`. Done with MLX ops that is two
gather_mm, a cast and an add: four kernel launches for every adapted layer, each ~10 µs on
MLX's CUDA backend whatever its size (benchmarks/lora_step_probe.py), which at decode, where
the updates themselves are tiny, cost more than the updates. This kernel does it in one
launch, and for up to MAX_GROUP layers that read the same input (an attention's q, k and v
projections; an MLP's gate and up) in that same launch: a block per (layer, row, 256 outputs)
first reduces the row's `x @ A` (R values; each block again: A is a few KB, read from L2),
then writes its 256 outputs `y + h @ B`, in float.

Used for decode steps (one token a row) with ranks up to MAX_RANK and no DoRA gain; prefill
chunks and everything else keep the MLX ops, whose matmuls are the faster there. On Metal
and CPU it is never used (`usable()`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

THREADS = 256
MAX_RANK = 16  # above it the redundant A reads of every block cost more than the launches saved
MAX_GROUP = 3

_HEADER = """
template <int R, int DIN, int DOUT, typename TX, typename TY, typename TW, typename TO>
__device__ void mlxd_lora_block(const TX* x, const TY* y, const TW* A, const TW* B, const uint32_t* slots,
                                TO* out, int bx) {
    constexpr int WARPS = 256 / 32;
    __shared__ float partial[WARPS][R];
    __shared__ float h[R];
    const int row = blockIdx.y;
    const int tid = threadIdx.x;
    const int slot = static_cast<int>(slots[row]);
    const TX* xr = x + static_cast<size_t>(row) * DIN;
    const TW* a = A + static_cast<size_t>(slot) * DIN * R;
    float acc[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (int i = tid; i < DIN; i += 256) {
        const float xv = static_cast<float>(xr[i]);
        const TW* ai = a + static_cast<size_t>(i) * R;
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
    const int j = bx * 256 + tid;
    if (j < DOUT) {
        const TW* b = B + static_cast<size_t>(slot) * R * DOUT + j;
        float d = 0.0f;
        #pragma unroll
        for (int r = 0; r < R; ++r) d += h[r] * static_cast<float>(b[static_cast<size_t>(r) * DOUT]);
        const size_t at = static_cast<size_t>(row) * DOUT + j;
        out[at] = static_cast<TO>(static_cast<float>(y[at]) + d);
    }
}
"""


def _source(count: int) -> str:
    """The kernel's body for `count` layers: each block finds its layer by its x index."""
    lines = ["    const int bx = blockIdx.x;"]
    for k in range(count):
        lines.append(f"    if (bx >= OFF{k} && bx < OFF{k + 1}) {{ mlxd_lora_block<R{k}, DIN, DOUT{k}>"
                     f"(x, y{k}, A{k}, B{k}, slots, out{k}, bx - OFF{k}); return; }}")
    return "\n".join(lines)


@functools.cache
def usable() -> bool:
    """Whether this process runs MLX on an NVIDIA GPU (the kernel is CUDA)."""
    try:
        return bool(mx.cuda.is_available()) and mx.default_device().type == mx.gpu
    except AttributeError:  # an MLX without its CUDA module
        return False


@functools.cache
def _kernel(count: int) -> Any:
    inputs = ["x", "slots", *(f"{n}{k}" for k in range(count) for n in ("y", "A", "B"))]
    return mx.fast.cuda_kernel(name=f"mlxd_lora_rows{count}", input_names=inputs,
                               output_names=[f"out{k}" for k in range(count)], source=_source(count), header=_HEADER)


def fits(x: mx.array, a: mx.array) -> bool:
    """Whether the kernel takes this step: one token a row, an A (one stack's, or stacked per
    slot) of a small rank."""
    return x.ndim == 3 and x.shape[1] == 1 and a.ndim in (2, 3) and a.shape[-1] <= MAX_RANK


def rows_update_group(x: mx.array, slots: mx.array,
                      layers: Sequence[tuple[mx.array, mx.array, mx.array]]) -> list[mx.array]:
    """For each (y, a, b) of layers that read `x`: `y + (x[i] @ a[slots[i]]) @ b[slots[i]]` for
    every row i, in y's dtype (x: (N, 1, in), y: (N, 1, out), a: (S, in, R), b: (S, R, out),
    slots: (N,) uint32; a 2-D a and b are one slot's); all in one launch."""
    n, d_in = x.shape[0], x.shape[2]
    template: list[tuple[str, Any]] = [("DIN", d_in)]
    inputs = [x, slots]
    offset = 0
    layers = [(y, a[None] if a.ndim == 2 else a, b[None] if b.ndim == 2 else b) for y, a, b in layers]
    for k, (y, a, b) in enumerate(layers):
        template += [(f"R{k}", a.shape[2]), (f"DOUT{k}", y.shape[-1]), (f"OFF{k}", offset)]
        inputs += [y, a, b]
        offset += (y.shape[-1] + THREADS - 1) // THREADS
    template.append((f"OFF{len(layers)}", offset))
    return list(_kernel(len(layers))(
        inputs=inputs, template=template, grid=(offset * THREADS, n, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[y.shape for y, _, _ in layers], output_dtypes=[y.dtype for y, _, _ in layers],
    ))


def rows_update(x: mx.array, y: mx.array, a: mx.array, b: mx.array, slots: mx.array) -> mx.array:
    """One layer's `rows_update_group`."""
    return rows_update_group(x, slots, [(y, a, b)])[0]
