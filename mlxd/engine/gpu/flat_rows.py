"""Batched decode through quantized layers: one pass over the weights for all rows.

A batched decode step feeds each linear layer rows shaped (B, 1, K). On MLX's CUDA backend
`quantized_matmul` on that shape makes one pass over the weights per row (an 8B 4-bit
projection: 216 us at B=8, 424 us at B=16), while the same rows flattened to (B, K) take 35 us
from 8 rows up (../shared/tools/gpu/qmm_shape_probe.py; below 8 rows it runs per row either
way, and padding up to 8 cost more than it saved). So the loaded model's quantized layers
flatten such input from FLATTEN_MIN_ROWS rows up: the result is the same matrix product, in
one kernel. Only the model's own layer objects change class; nothing global is patched.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

FLATTEN_MIN_ROWS = 8


class RowFlatQuantizedLinear(nn.QuantizedLinear):
    """QuantizedLinear that runs (B, 1, K) input as (B, K) when B >= FLATTEN_MIN_ROWS."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim == 3 and x.shape[1] == 1 and x.shape[0] >= FLATTEN_MIN_ROWS:
            return super().__call__(x.reshape(x.shape[0], x.shape[2]))[:, None, :]
        return super().__call__(x)


def flatten_quantized_rows(model: Any) -> int:
    """Switch the model's QuantizedLinear layers to RowFlatQuantizedLinear; how many changed."""
    changed = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear:
            module.__class__ = RowFlatQuantizedLinear
            changed += 1
    return changed


def wins_here() -> bool:
    """Where the flattened shape is measured to win: MLX's CUDA backend."""
    return bool(mx.cuda.is_available())
