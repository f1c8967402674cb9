"""Batched decode attention without a mask, for MLX's CUDA backend.

In a batched decode step mlx-lm's `BatchKVCache` left-pads rows to one length and hands
attention an array mask. MLX's CUDA backend runs attention with an array mask unfused (its
fused vector kernel takes none): 20-30% of a 1B model's step at 8-16 rows
(docs/benchmarks.md, "Where a batched decode step goes"). The mask of a decode step only says
where each row's keys start, so this kernel takes those starts instead: one thread block per
(row, head), warps taking keys in turn with an online softmax, reading the cache in place.

`install(model)` routes the loaded model's attention through `decode_sdpa`, which runs the
kernel only for what it was checked on (a single query per row, a `BatchKVCache`, the head
sizes and dtype verified against MLX's masked attention on first use), sends prefill chunks to
prefill_attention.py (cuDNN's attention or MLX's unfused one) and hands everything else to
mlx-lm's own function. It replaces that function in the model's own module of mlx-lm (an
engine process loads one model); `MLXD_FUSED_DECODE_ATTENTION=0` turns the kernel off.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxd.engine.gpu import prefill_attention

log = logging.getLogger("mlxd.engine")

ENV = "MLXD_FUSED_DECODE_ATTENTION"
# Warps sharing one (row, head), by context length: on the H200 4 and 8 warps ran alike up to
# 1,200 keys, 8 and 16 did best at 4,000, 32 was slowest everywhere (docs/benchmarks.md).
WARP_STEPS = ((1024, 4), (4096, 8))
MOST_WARPS = 16
KEYS_AT_ONCE = 4
TOLERANCE = {mx.float32: 1e-3, mx.float16: 2e-2, mx.bfloat16: 6e-2}

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
    #pragma unroll
    for (int i = 0; i < PER; ++i) {
        qv[i] = static_cast<float>(q[b * q_strides[0] + h * q_strides[1] + (lane * PER + i) * q_strides[3]]) * sc;
    }
    float m = -1.0e30f, s = 0.0f, acc[PER];
    #pragma unroll
    for (int i = 0; i < PER; ++i) acc[i] = 0.0f;
    const size_t kb0 = (size_t)b * k_strides[0] + (size_t)kvh * k_strides[1];
    const size_t vb0 = (size_t)b * v_strides[0] + (size_t)kvh * v_strides[1];
    for (int base = starts[b] + warp * G; base < L; base += NW * G) {
        float dots[G];
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            float d = 0.0f;
            if (base + g < L) {
                const size_t kb = kb0 + (size_t)(base + g) * k_strides[2];
                #pragma unroll
                for (int i = 0; i < PER; ++i) d += qv[i] * static_cast<float>(k[kb + (lane * PER + i) * k_strides[3]]);
            }
            dots[g] = d;
        }
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            #pragma unroll
            for (int g = 0; g < G; ++g) dots[g] += __shfl_xor_sync(0xffffffff, dots[g], off);
        }
        float top = m;
        #pragma unroll
        for (int g = 0; g < G; ++g) if (base + g < L) top = fmaxf(top, dots[g]);
        const float corr = __expf(m - top);
        s *= corr;
        #pragma unroll
        for (int i = 0; i < PER; ++i) acc[i] *= corr;
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            if (base + g < L) {
                const float p = __expf(dots[g] - top);
                s += p;
                const size_t vb = vb0 + (size_t)(base + g) * v_strides[2];
                #pragma unroll
                for (int i = 0; i < PER; ++i) acc[i] += p * static_cast<float>(v[vb + (lane * PER + i) * v_strides[3]]);
            }
        }
        m = top;
    }
    __shared__ float part_m[NW], part_s[NW], part_acc[NW][D];
    if (lane == 0) { part_m[warp] = m; part_s[warp] = s; }
    #pragma unroll
    for (int i = 0; i < PER; ++i) part_acc[warp][lane * PER + i] = acc[i];
    __syncthreads();
    if (warp == 0) {
        float top = -1.0e30f;
        for (int w = 0; w < NW; ++w) top = fmaxf(top, part_m[w]);
        float total = 0.0f, out[PER];
        #pragma unroll
        for (int i = 0; i < PER; ++i) out[i] = 0.0f;
        for (int w = 0; w < NW; ++w) {
            const float c = part_m[w] <= -1.0e29f ? 0.0f : __expf(part_m[w] - top);
            total += part_s[w] * c;
            #pragma unroll
            for (int i = 0; i < PER; ++i) out[i] += part_acc[w][lane * PER + i] * c;
        }
        #pragma unroll
        for (int i = 0; i < PER; ++i) o[((size_t)b * H + h) * D + lane * PER + i] = static_cast<T>(out[i] / total);
    }
"""

# The same kernel for a batch whose mask says more than where rows start (spec/holes.py's
# HoleyKV: a row's refused drafts stay in the buffer, masked out): each key is also looked up
# in the step's mask. Made from SOURCE by text, so the unmasked kernel stays as it is.
MASKED_SOURCE = SOURCE.replace(
    "base + g < L", "(base + g < L && keep[(size_t)b * keep_strides[0] + (size_t)(base + g) * keep_strides[3]])")

_kernels: dict[bool, Any] = {}  # by masked
_scales: dict[float, mx.array] = {}
_verdicts: dict[tuple[int, int, int, Any], bool] = {}
_masked_verdicts: dict[tuple[int, int, int, Any], bool] = {}


def enabled() -> bool:
    """On MLX's CUDA backend, unless MLXD_FUSED_DECODE_ATTENTION=0."""
    return os.environ.get(ENV, "1") != "0" and bool(mx.cuda.is_available())



def warps_for(keys: int) -> int:
    """Warps a block uses for a context of `keys` keys (one compiled kernel per count)."""
    return next((warps for longest, warps in WARP_STEPS if keys <= longest), MOST_WARPS)


def fused(q: mx.array, k: mx.array, v: mx.array, starts: mx.array, scale: float, warps: int = 0,
          keep: mx.array | None = None) -> mx.array:
    """Attention of one query per row over keys [starts[b], L) of row b; q is (B, H, 1, D). With
    `keep` (B, 1, 1, L) boolean, only the keys it marks in that range take part."""
    masked = keep is not None
    kernel: Any = _kernels.get(masked)
    if kernel is None:
        kernel = _kernels[masked] = mx.fast.cuda_kernel(
            name="mlxd_decode_sdpa_masked" if masked else "mlxd_decode_sdpa",
            input_names=["q", "k", "v", "starts", "scale", *(["keep"] if masked else [])], output_names=["o"],
            source=MASKED_SOURCE if masked else SOURCE, ensure_row_contiguous=False,
        )
    if (scale_arr := _scales.get(scale)) is None:
        scale_arr = _scales[scale] = mx.array([scale], dtype=mx.float32)
    B, H, _, D = q.shape
    warps = warps or warps_for(k.shape[2])
    return kernel(
        inputs=[q, k, v, starts, scale_arr, *([keep] if masked else [])],
        template=[("T", q.dtype), ("D", D), ("NW", warps), ("G", KEYS_AT_ONCE)],
        grid=(H * 32 * warps, B, 1), threadgroup=(32 * warps, 1, 1),
        output_shapes=[(B, H, 1, D)], output_dtypes=[q.dtype],
    )[0]


def reference(q: mx.array, k: mx.array, v: mx.array, starts: mx.array, scale: float) -> mx.array:
    """MLX's own attention with the mask a BatchKVCache makes for a decode step."""
    mask = mx.arange(k.shape[2])[None, None, None, :] >= starts[:, None, None, None]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def verdict(verdicts: dict[Any, bool], key: tuple[int, int, int, Any], max_error: Callable[[], float],
            tolerance: float, what: str) -> bool:
    """Whether `what` may serve attention for `key` (heads, kv_heads, dim, dtype): its largest
    difference from MLX's masked attention, `max_error()`, within `tolerance`. Asked once per key;
    a difference or an error is logged and keeps MLX's attention."""
    if (known := verdicts.get(key)) is not None:
        return known
    heads, kv_heads, dim, dtype = key
    try:
        err = max_error()
        ok = err <= tolerance
        if not ok:
            log.warning("%s differs from MLX's (max %.4g) for %d/%d heads of %d, %s: not used",
                        what, err, heads, kv_heads, dim, dtype)
    except Exception as exc:  # what MLX cannot build or run here: its own attention serves
        log.warning("%s unavailable (%s): not used", what, exc)
        ok = False
    verdicts[key] = ok
    return ok


def check(heads: int, kv_heads: int, dim: int, dtype: Any, masked: bool = False) -> bool:
    """Whether the kernel (its masked variant: `masked`) matches MLX's masked attention for these
    sizes (once per sizes), with every warp count: each is compiled here, at the first batched
    step (warm-up), not later. The masked variant is compiled and checked then too: a batch's
    first refused draft must not wait for its compiles."""
    if not masked and (heads, kv_heads, dim, dtype) not in _verdicts:
        check(heads, kv_heads, dim, dtype, masked=True)

    def max_error() -> float:
        kq, kk, kv = mx.random.split(mx.random.key(7), 3)
        B, L, alloc = 3, 45, 64
        q = mx.random.normal((B, 1, heads, dim), key=kq).astype(dtype).transpose(0, 2, 1, 3)
        k = mx.random.normal((B, kv_heads, alloc, dim), key=kk).astype(dtype)[:, :, :L, :]
        v = mx.random.normal((B, kv_heads, alloc, dim), key=kv).astype(dtype)[:, :, :L, :]
        starts = mx.array([0, 7, L - 1], dtype=mx.int32)
        scale = dim**-0.5
        keep = holey_mask(starts, L) if masked else None
        want = (mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=keep) if masked
                else reference(q, k, v, starts, scale)).astype(mx.float32)
        counts = sorted({warps for _, warps in WARP_STEPS} | {MOST_WARPS})
        return max(float(mx.max(mx.abs(fused(q, k, v, starts, scale, w, keep).astype(mx.float32) - want)).item())  # type: ignore[arg-type]
                   for w in counts)

    return verdict(_masked_verdicts if masked else _verdicts, (heads, kv_heads, dim, dtype), max_error,
                   TOLERANCE.get(dtype, 1e-3), "fused decode attention" + (" (masked)" if masked else ""))


def holey_mask(starts: mx.array, length: int) -> mx.array:
    """A decode step's mask (B, 1, 1, length) for rows starting at `starts`, with holes: every
    third key of each row left out, and a run of five in the middle (a refused draft's)."""
    keys = mx.arange(length)[None, :]
    holes = (keys % 3 == 1) | ((keys >= length // 2) & (keys < length // 2 + 5))
    return ((keys >= starts[:, None]) & ~(holes & (keys < length - 1))).reshape(-1, 1, 1, length)


def batched_decode_step(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, mask: Any,
                        sinks: Any) -> bool:
    """Whether this call is a batch cache's single-token step with a boolean mask of one row each
    (where each row's keys start, and for a subclass such as spec/holes.py's HoleyKV which keys
    are left out), no attention sinks, and one dtype and head size throughout."""
    if not isinstance(cache, BatchKVCache) or sinks is not None or not isinstance(mask, mx.array):
        return False
    B, H, N, D = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    return (N == 1 and mask.dtype == mx.bool_ and mask.shape[-1] == S and mask.size == B * S and H % Hk == 0
            and keys.shape[3] == D and values.shape[3] == D and keys.dtype == values.dtype == queries.dtype)


def suits(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, mask: Any, sinks: Any) -> bool:
    """Whether this call is a batched decode step the kernel was made for."""
    if not batched_decode_step(queries, keys, values, cache, mask, sinks):
        return False
    H, D = queries.shape[1], queries.shape[3]
    return (D % 32 == 0 and D <= 256 and queries.dtype in TOLERANCE
            and check(H, keys.shape[1], D, queries.dtype, masked=needs_mask(cache)))


def needs_mask(cache: Any) -> bool:
    """Whether a batch cache's mask says more than where its rows start (a subclass's holes)."""
    return type(cache) is not BatchKVCache


def wrap(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """mlx-lm's scaled_dot_product_attention, with batched decode steps sent to the kernel and
    prefill chunks to prefill_attention.route."""

    fused_on = os.environ.get(ENV, "1") != "0"

    def decode_sdpa(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                    mask: Any, sinks: Any = None) -> mx.array:
        if fused_on and suits(queries, keys, values, cache, mask, sinks):
            starts = cache.left_padding
            if starts.dtype != mx.int32:
                starts = starts.astype(mx.int32)
            return fused(queries, keys, values, starts, scale, keep=mask if needs_mask(cache) else None)
        if queries.shape[2] > 1:
            return prefill_attention.route(original, queries, keys, values, cache, scale, mask, sinks)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    return decode_sdpa


def plain_causal(model: Any) -> bool:
    """Whether every layer keeps a plain KVCache (no sliding window, no state cache): then a
    batched decode step's mask only marks where each row's keys start."""
    make_cache = getattr(model, "make_cache", None)
    return make_cache is None or all(type(c) is KVCache for c in make_cache())


def install(model: Any, wrapper: Callable[[Callable[..., mx.array]], Callable[..., mx.array]] = wrap) -> list[str]:
    """Route the model's attention through `wrapper(mlx-lm's function)` (decode_sdpa unless
    given: cpu_attention.py passes its own); the modules changed. A vision-language model's
    modules from mlx-vlm (its image prefill runs them) are routed the same way, from
    mlx-vlm's own function, which takes the same arguments."""
    changed: list[str] = []
    if not plain_causal(model):
        return changed
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    for name in sorted(names):
        module = sys.modules.get(name)
        original = _original_of(name)
        if module is not None and original is not None and getattr(module, "scaled_dot_product_attention", None) is original:
            setattr(module, "scaled_dot_product_attention", wrapper(original))  # type: ignore[arg-type]  # noqa: B010
            changed.append(name)
    return changed


def _original_of(name: str) -> Callable[..., mx.array] | None:
    """The scaled_dot_product_attention a model module of mlx-lm or mlx-vlm uses (its package's base's)."""
    for package in ("mlx_lm.models", "mlx_vlm.models"):
        if name.startswith(package + ".") and (base := sys.modules.get(package + ".base")) is not None:
            return getattr(base, "scaled_dot_product_attention", None)
    return None
