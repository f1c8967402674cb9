"""Which quantized KV settings this backend can run: mlx-lm's quantized attention (the path
`--kv-bits` takes) for each bits x group size, at a decode step, a short and a long prefill
chunk over a long cache, with an 8B-like head layout (32 query heads, 8 KV heads, head dim 128).

  python benchmarks/kv_quant_probe.py        # prints one line a setting: ok, or the error
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention


def probe(bits: int, group: int, q_len: int, keys: int) -> str:
    q = mx.random.normal((1, 32, q_len, 128)).astype(mx.bfloat16)
    k = mx.random.normal((1, 8, keys, 128)).astype(mx.bfloat16)
    v = mx.random.normal((1, 8, keys, 128)).astype(mx.bfloat16)
    qk = mx.quantize(k, group_size=group, bits=bits)
    qv = mx.quantize(v, group_size=group, bits=bits)
    try:
        out = quantized_scaled_dot_product_attention(q, qk, qv, scale=128**-0.5, mask="causal" if q_len > 1 else None,
                                                     group_size=group, bits=bits)
        mx.eval(out)
        return "ok"
    except Exception as exc:  # what the backend says is the result
        return f"{type(exc).__name__}: {str(exc)[:160]}"


def main() -> None:
    print("device:", mx.default_device())
    for bits in (4, 8):
        for group in (32, 64, 128):
            for q_len in (1, 64, 512):
                print(f"bits {bits} group {group:3d} queries {q_len:3d} keys 4096: {probe(bits, group, q_len, 4096)}",
                      flush=True)


if __name__ == "__main__":
    main()
