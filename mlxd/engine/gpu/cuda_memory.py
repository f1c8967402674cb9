"""What the NVIDIA driver says of the GPU's memory, beside what MLX accounts for (device_memory.py).

MLX counts the buffers it hands out and the freed ones it keeps. The card holds more: the CUDA
context, cuBLAS's and cuDNN's workspaces, managed memory (MLX moves a buffer there when the host
reads it), and the memory pool behind `cudaMallocAsync`, which keeps freed blocks until it is
asked to release them. When an allocation fails with MLX's figures far below the card's size,
these say where the rest went. Read through the driver API (`libcuda.so.1`, which MLX's CUDA
backend loads); anywhere else, or on any error, there is nothing to say.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

POOL_RESERVED_CURRENT, POOL_RESERVED_HIGH, POOL_USED_CURRENT, POOL_USED_HIGH = 5, 6, 7, 8  # CUmemPool_attribute


@functools.cache
def _driver() -> Any | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return lib if lib.cuInit(0) == 0 else None


def cuda_memory(device: int = 0) -> dict[str, int] | None:
    """The card's used and total bytes, and its default memory pool's reserved and used bytes (now
    and at their highest), in bytes; None where there is no CUDA driver or it will not say."""
    lib = _driver()
    if lib is None:
        return None
    current = ctypes.c_void_p()
    pushed = ctx = None
    try:
        if lib.cuCtxGetCurrent(ctypes.byref(current)) != 0:
            return None
        if not current.value:  # a thread the CUDA runtime never ran on: borrow the primary context
            ctx = ctypes.c_void_p()
            if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) != 0:
                ctx = None
                return None
            if lib.cuCtxPushCurrent_v2(ctx) != 0:
                return None
            pushed = True
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != 0:
            return None
        out = {"device_used": total.value - free.value, "device_total": total.value}
        pool = ctypes.c_void_p()
        if lib.cuDeviceGetDefaultMemPool(ctypes.byref(pool), device) == 0:
            for name, attr in (("pool_reserved", POOL_RESERVED_CURRENT), ("pool_reserved_high", POOL_RESERVED_HIGH),
                               ("pool_used", POOL_USED_CURRENT), ("pool_used_high", POOL_USED_HIGH)):
                value = ctypes.c_uint64()
                if lib.cuMemPoolGetAttribute(pool, attr, ctypes.byref(value)) == 0:
                    out[name] = value.value
        return out
    finally:
        if pushed:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        if ctx is not None:
            lib.cuDevicePrimaryCtxRelease_v2(device)


def trim_pool(device: int = 0) -> int | None:
    """Hand what the CUDA memory pool holds unused back to the device, once the GPU is done with
    what was freed (`cuCtxSynchronize`, then `cuMemPoolTrimTo`); the bytes released, None where
    there is no CUDA driver or it will not say.

    The pool keeps what it once reserved: after an engine's warm-up it held 75.2 GiB of an H100's
    79.2 with 6.5 GiB in use, and a later allocation of a size its free pieces could not hold found
    no device memory left to grow into. Call it where the GPU may wait (after the warm-up, after a
    failed step), on a thread that has run CUDA work (the GPU thread), after `mx.clear_cache()`."""
    lib = _driver()
    before = cuda_memory(device)
    if lib is None or before is None or "pool_reserved" not in before:
        return None
    pool = ctypes.c_void_p()
    if (lib.cuCtxSynchronize() != 0 or lib.cuDeviceGetDefaultMemPool(ctypes.byref(pool), device) != 0
            or lib.cuMemPoolTrimTo(pool, ctypes.c_size_t(0)) != 0):
        return None
    after = cuda_memory(device) or {}
    return max(0, before["pool_reserved"] - after.get("pool_reserved", before["pool_reserved"]))


def cuda_memory_line(memory: dict[str, int] | None) -> str:
    """`memory` (cuda_memory's) in GiB for a log line; empty where there is none."""
    if not memory:
        return ""
    gib = 1024**3
    line = f"; the card: {memory['device_used'] / gib:.1f} of {memory['device_total'] / gib:.1f} GiB used"
    if "pool_reserved" in memory:
        line += (f", CUDA pool reserved {memory['pool_reserved'] / gib:.1f} GiB"
                 f" (high {memory.get('pool_reserved_high', 0) / gib:.1f}),"
                 f" in use {memory.get('pool_used', 0) / gib:.1f} GiB (high {memory.get('pool_used_high', 0) / gib:.1f})")
    return line
