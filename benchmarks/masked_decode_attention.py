"""Probe (CUDA only): a fused decode attention that takes each row's first valid key instead of a mask.

In a batched decode step mlx-lm's BatchKVCache left-pads rows to one length and passes an
array mask, and MLX's CUDA backend then runs attention unfused (its vector kernel takes no
array mask): 20-30% of a 1B model's step at 8-16 rows (docs/benchmarks.md, "Where a batched
decode step goes"). This probe builds one kernel with `mx.fast.cuda_kernel` that reads the
KV cache in place (strided, as the cache's slice is), skips each row's padding, and does an
online softmax; it checks the kernel against `mx.fast.scaled_dot_product_attention` with the
mask, then times both. Not used by the engine: this is the first step of that work.

  python3 benchmarks/masked_decode_attention.py
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx

WARPS = 4
SOURCE = """
    constexpr int PER = D / 32;
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int H = q_shape[1];
    const int kvh = h / (H / k_shape[1]);
    const int L = k_shape[2];
    const float sc = scale[0];

    float qv[PER];
    for (int i = 0; i < PER; ++i) {
        qv[i] = static_cast<float>(q[b * q_strides[0] + h * q_strides[1] + (lane * PER + i) * q_strides[3]]) * sc;
    }
    float m = -1.0e30f, s = 0.0f, acc[PER];
    for (int i = 0; i < PER; ++i) acc[i] = 0.0f;
    for (int l = starts[b] + warp; l < L; l += NW) {
        const size_t kb = b * k_strides[0] + kvh * k_strides[1] + (size_t)l * k_strides[2];
        float dot = 0.0f;
        for (int i = 0; i < PER; ++i) dot += qv[i] * static_cast<float>(k[kb + (lane * PER + i) * k_strides[3]]);
        for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, off);
        const float m_new = fmaxf(m, dot);
        const float corr = __expf(m - m_new);
        const float p = __expf(dot - m_new);
        s = s * corr + p;
        const size_t vb = b * v_strides[0] + kvh * v_strides[1] + (size_t)l * v_strides[2];
        for (int i = 0; i < PER; ++i) acc[i] = acc[i] * corr + p * static_cast<float>(v[vb + (lane * PER + i) * v_strides[3]]);
        m = m_new;
    }
    __shared__ float part_m[NW], part_s[NW], part_acc[NW][D];
    if (lane == 0) { part_m[warp] = m; part_s[warp] = s; }
    for (int i = 0; i < PER; ++i) part_acc[warp][lane * PER + i] = acc[i];
    __syncthreads();
    if (warp == 0) {
        float top = -1.0e30f;
        for (int w = 0; w < NW; ++w) top = fmaxf(top, part_m[w]);
        float total = 0.0f, out[PER];
        for (int i = 0; i < PER; ++i) out[i] = 0.0f;
        for (int w = 0; w < NW; ++w) {
            const float c = part_m[w] <= -1.0e29f ? 0.0f : __expf(part_m[w] - top);
            total += part_s[w] * c;
            for (int i = 0; i < PER; ++i) out[i] += part_acc[w][lane * PER + i] * c;
        }
        for (int i = 0; i < PER; ++i) o[(b * H + h) * D + lane * PER + i] = static_cast<T>(out[i] / total);
    }
"""


def build():  # type: ignore[no-untyped-def]
    return mx.fast.cuda_kernel(
        name="mlxd_masked_decode_sdpa", input_names=["q", "k", "v", "starts", "scale"], output_names=["o"],
        source=SOURCE, ensure_row_contiguous=False,
    )


def fused(kernel, q: mx.array, k: mx.array, v: mx.array, starts: mx.array, scale: float) -> mx.array:  # type: ignore[no-untyped-def]
    B, H, _, D = q.shape
    return kernel(
        inputs=[q, k, v, starts, mx.array([scale], dtype=mx.float32)],
        template=[("T", q.dtype), ("D", D), ("NW", WARPS)],
        grid=(H * 32 * WARPS, B, 1), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(B, H, 1, D)], output_dtypes=[q.dtype],
    )[0]


def reference(q: mx.array, k: mx.array, v: mx.array, starts: mx.array, scale: float) -> mx.array:
    L = k.shape[2]
    mask = mx.arange(L)[None, None, None, :] >= starts[:, None, None, None]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def case(kernel, B: int, H: int, Hk: int, D: int, L: int, iters: int) -> str:  # type: ignore[no-untyped-def]
    alloc = ((L + 255) // 256) * 256 + 256  # the cache's buffer is longer than what is filled, as in mlx-lm
    q = mx.random.normal((B, 1, H, D)).astype(mx.bfloat16).transpose(0, 2, 1, 3)  # strided, as a model makes it
    k = mx.random.normal((B, Hk, alloc, D)).astype(mx.bfloat16)[:, :, :L, :]
    v = mx.random.normal((B, Hk, alloc, D)).astype(mx.bfloat16)[:, :, :L, :]
    starts = mx.array([(r * 37) % max(1, L // 2) for r in range(B)], dtype=mx.int32)
    scale = D ** -0.5
    got, want = fused(kernel, q, k, v, starts, scale), reference(q, k, v, starts, scale)
    err = mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item()
    timings = {}
    for name, fn in (("fused", lambda: fused(kernel, q, k, v, starts, scale)), ("masked sdpa", lambda: reference(q, k, v, starts, scale))):
        for _ in range(20):
            mx.eval(fn())
        t = time.perf_counter()
        for _ in range(iters):
            mx.eval(fn())
        timings[name] = (time.perf_counter() - t) / iters * 1e6
    return (f"B={B} H={H} Hk={Hk} D={D} L={L}: max |diff| {err:.4f}; "
            f"fused {timings['fused']:.1f} us, masked sdpa {timings['masked sdpa']:.1f} us (one eval per call)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=200)
    a = p.parse_args()
    if not mx.cuda.is_available():
        sys.exit("this probe needs MLX's CUDA backend")
    kernel = build()
    for B, H, Hk, D, L in [(8, 32, 8, 64, 300), (16, 32, 8, 64, 300), (8, 32, 8, 128, 300), (16, 32, 8, 128, 1200)]:
        print(case(kernel, B, H, Hk, D, L, a.iters), flush=True)


if __name__ == "__main__":
    main()
