"""`--kv-bits`: checked at load, so an engine that cannot run quantized KV says so once, at
start, instead of failing every request.

Two things stop it: a group size that does not divide the model's head size (mlx quantizes
along the head), and a backend without kernels for the quantized attention at this model's
shapes (MLX's CUDA backend has no `quantized_matmul` for some of them). The second is found by
running mlx-lm's quantized attention once at the model's head layout: a decode step and a
short prefill over a few quantized keys.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxd.protocol.memory import head_size

FLOATS = (mx.float16, mx.bfloat16, mx.float32)


def activation_dtype(model: Any) -> mx.Dtype:
    """The dtype the model computes in: its first floating parameter's (a quantized model's
    scales carry it)."""
    flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for _, p in flat:
        if isinstance(p, mx.array) and p.dtype in FLOATS:
            return p.dtype
    return mx.float16


def check_quantized_kv(config: dict[str, Any], dtype: mx.Dtype, bits: int, group_size: int) -> None:
    """ValueError, saying what to do, when this model cannot run with KV quantized to
    `bits` in groups of `group_size` here."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    size = head_size(config)
    if size % group_size:
        raise ValueError(f"--kv-bits: this model's attention heads have {size} values, not a multiple of "
                         f"--kv-group-size {group_size}; choose a group size that divides {size}")
    heads = int(config.get("num_attention_heads") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    keys = mx.zeros((1, kv_heads, 64, size), dtype=dtype)
    q_keys = mx.quantize(keys, group_size=group_size, bits=bits)
    try:
        for queries in (1, 8):
            q = mx.zeros((1, heads, queries, size), dtype=dtype)
            causal = mx.arange(64 - queries, 64)[:, None] >= mx.arange(64)[None]
            mx.eval(quantized_scaled_dot_product_attention(
                q, q_keys, q_keys, scale=size**-0.5, mask=causal if queries > 1 else None,
                group_size=group_size, bits=bits))
    except Exception as exc:  # the backend's own words are the reason
        raise ValueError(f"--kv-bits {bits} --kv-group-size {group_size}: this MLX backend ({mx.default_device()}) "
                         f"cannot run quantized attention for this model ({exc}); start without --kv-bits, or "
                         f"try another --kv-bits/--kv-group-size") from exc
