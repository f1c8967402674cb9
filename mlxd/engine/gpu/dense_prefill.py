"""Prefill through quantized layers: the weights dequantized, then a dense matmul (CUDA, CPU).

MLX's CUDA backend multiplies a chunk of many tokens by quantized weights far below what the
GPU can do: on an H100 an 8B 4-bit model's pass of 2,048 tokens over 5,024 cached ones took
232 ms with `quantized_matmul`, and 72 ms with each layer's weights dequantized to the
activations' dtype and multiplied by MLX's dense matmul (cuBLAS); 512 tokens 90 against 56 ms,
48 tokens 36 against 32 ms. Below about 32 tokens the quantized kernel is as fast or faster (2
tokens: 17 against 28 ms), and a decode step's one row a sequence stays on it
(docs/benchmarks.md, issue 29: `benchmarks/chunk_sweep.py --ways plain,dequant`). MLX's CPU
backend is further off: SmolLM2 at 4 bits on the 2-core CPU took 52 s for a 512-token pass
with `quantized_matmul` and 5.4 s dequantized (3.1 against 0.76 s for 32 tokens). Metal's
quantized kernels are Apple's own, tuned for such passes, and are left alone (not measured).

So on CUDA and the CPU the loaded model's quantized linear layers run input of `min_tokens()`
positions or more (a prefill chunk of one sequence or of a batch: (B, L, K) with L that long) that way.
The dequantized weights live only while their matmul runs; MLX queues a pass ahead of the GPU
until its memory limit, so a long chunk may hold several layers' of them at once (about 11 GiB
more at the peak for the 8B model's 2,048-token chunks on the H100), within the limit the
engine sets (loader.py). Only the model's own layer objects change class; `install` checks the
first layer against `quantized_matmul` before it changes any. `MLXD_DENSE_PREFILL=0` keeps
MLX's quantized kernels for every shape.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxd.engine.gpu.flat_rows import RowFlatQuantizedLinear

log = logging.getLogger("mlxd.engine")

ENV = "MLXD_DENSE_PREFILL"
# From how many positions the dense way wins: on the H100 from about 24 (32 is kept), on the
# 2-core CPU from under 8 (8 tokens 0.46 against 0.93 s; 2 tokens 0.37 against 0.21 s).
GPU_MIN_TOKENS = 32
CPU_MIN_TOKENS = 8
# The difference's norm against the output's. A wrong layout or mode is off by the output's size;
# rounding is not: on the CPU MLX's quantized kernel is itself 1.8% off the exact product for a
# bfloat16 layer (the dense way 0.17%), and bfloat16 weights round at about 0.4%.
TOLERANCE = 5e-2

_classes: dict[type, type] = {}
# The layer classes whose __call__ is a quantized matmul and nothing more (a subclass of its own,
# such as a distributed or adapted layer, may do more, and is left alone).
PLAIN = (nn.QuantizedLinear, RowFlatQuantizedLinear)


def enabled() -> bool:
    """On MLX's CUDA and CPU backends (not Metal), unless MLXD_DENSE_PREFILL=0."""
    here = bool(mx.cuda.is_available()) or mx.default_device().type == mx.DeviceType.cpu
    return os.environ.get(ENV, "1") != "0" and here


def dense(layer: Any, x: mx.array) -> mx.array:
    """`layer(x)` with its weights dequantized and a dense matmul: in x's dtype on a GPU (cuBLAS
    sums half-precision products in float32), in float32 on the CPU (MLX's CPU matmul sums
    bfloat16 in bfloat16: 2% off in norm against the quantized kernel)."""
    scales, biases = layer["scales"], layer.get("biases")
    if mx.default_device().type == mx.DeviceType.cpu and x.dtype != mx.float32:
        wide = mx.dequantize(layer["weight"], scales.astype(mx.float32),
                             biases.astype(mx.float32) if biases is not None else None,
                             group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
        y = (x.astype(mx.float32) @ wide.T).astype(x.dtype)
    else:
        w = mx.dequantize(layer["weight"], scales, biases, group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
        y = x @ w.astype(x.dtype).T
    return y + layer["bias"] if "bias" in layer else y


def min_tokens() -> int:
    """From how many positions a chunk goes the dense way on this device."""
    return CPU_MIN_TOKENS if mx.default_device().type == mx.DeviceType.cpu else GPU_MIN_TOKENS


_min_tokens = GPU_MIN_TOKENS  # this process's (install sets it: an engine runs on one device)


def _dense_class(cls: type) -> type:
    if (made := _classes.get(cls)) is not None:
        return made
    quantized = cls.__call__

    def call(self: Any, x: mx.array) -> mx.array:
        if x.ndim == 3 and x.shape[1] >= _min_tokens:
            return dense(self, x)
        return quantized(self, x)

    made = _classes[cls] = type(cls.__name__, (cls,), {"__call__": call, "__module__": cls.__module__})
    return made


def install(model: Any) -> int:
    """Switch the model's quantized linear layers to their dense-prefill classes; how many."""
    global _min_tokens
    _min_tokens = min_tokens()
    layers = [m for _, m in model.named_modules() if type(m) in PLAIN]
    if not layers or not _agrees(layers[0]):
        return 0
    for layer in layers:
        layer.__class__ = _dense_class(type(layer))
    return len(layers)


def _agrees(layer: Any) -> bool:
    """Whether the dense way gives the layer's own output for a chunk (within TOLERANCE)."""
    try:
        dtype = layer["scales"].dtype
        x = mx.random.normal((1, GPU_MIN_TOKENS, layer["weight"].shape[1] * 32 // layer.bits),
                             key=mx.random.key(3)).astype(dtype)
        want, got = layer(x).astype(mx.float32), dense(layer, x).astype(mx.float32)
        err, top = (float(mx.linalg.norm(a).item()) for a in (want - got, want))  # type: ignore[arg-type]
    except Exception as exc:  # a mode or shape the dense way does not take: the quantized kernel serves
        log.warning("dense prefill unavailable (%s: %s): MLX's quantized kernels serve every shape",
                    type(exc).__name__, exc)
        return False
    if err > TOLERANCE * top:
        log.warning("dense prefill differs from MLX's quantized matmul (%.4g of %.4g, in norm): not used", err, top)
        return False
    return True
