"""A GPU array's bytes copied into pinned host memory by a kernel on a side stream (CUDA only).

Reading a GPU array on the host through MLX moves its buffer to managed memory with a
synchronous `cudaMemcpy` on the reading thread, the GIL held (kv_layout.py): at 8 streams that
cost decode 3-6% with checkpoints on, however the reads were spread (docs/benchmarks.md, issue
29). This is the alternative to measure before it goes into the engine: page-locked host memory
from the driver (`cuMemHostAlloc`, mapped into the GPU's address space), and an MLX custom
kernel on a stream of its own that writes a block's bytes straight into it over PCIe. Nothing on
the host waits for the copy but the thread that writes the file, and MLX never reads the
block on the host, so no buffer moves.

`PinnedArena` hands out slices of one pinned allocation (a bump pointer, `reset` between
rounds); `copy_to_host(block, arena)` queues the kernel and returns the slice and a one-element
`done` array; `wait(done)` blocks (the GIL free) until the copy is made. Used by
checkpoint_copy_probe.py's `pinned` mode and by its own check:

  python3 benchmarks/pinned_copy.py          # correctness and bandwidth, on a CUDA machine
"""

from __future__ import annotations

import ctypes
import sys
import time
from typing import Any

import mlx.core as mx
import numpy as np

CU_MEMHOSTALLOC_PORTABLE, CU_MEMHOSTALLOC_DEVICEMAP = 0x01, 0x02
COPY_BLOCKS = 32  # thread blocks of 256 for a copy: PCIe-bound, so few SMs taken from decode

_SOURCE = """
    unsigned long long base = ((unsigned long long)dst[1] << 32) | (unsigned long long)dst[0];
    unsigned long long n = ((unsigned long long)size[1] << 32) | (unsigned long long)size[0];
    bool aligned = ((unsigned long long)src % 16 == 0) && (base % 16 == 0);  // an offset view may not be
    unsigned long long wide = aligned ? n / 16 : 0;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    const uint4* from = reinterpret_cast<const uint4*>(src);
    uint4* to = reinterpret_cast<uint4*>(base);
    for (unsigned long long k = i; k < wide; k += step) {
        to[k] = from[k];
    }
    for (unsigned long long k = wide * 16 + i; k < n; k += step) {
        reinterpret_cast<unsigned char*>(base)[k] = src[k];
    }
    __threadfence_system();
    if (i == 0) {
        done[0] = 1;
    }
"""
_kernel: Any = None
_side: Any = None


def _driver() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    if lib.cuInit(0) != 0:
        raise RuntimeError("cuInit failed")
    return lib


class PinnedArena:
    """One page-locked, GPU-mapped host allocation, handed out in 256-byte-aligned slices."""

    def __init__(self, nbytes: int, device: int = 0) -> None:
        self._lib = lib = _driver()
        ctx = ctypes.c_void_p()
        if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) != 0 or lib.cuCtxPushCurrent_v2(ctx) != 0:
            raise RuntimeError("no CUDA context")
        try:
            host = ctypes.c_void_p()
            err = lib.cuMemHostAlloc(ctypes.byref(host), ctypes.c_size_t(nbytes),
                                     CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP)
            if err != 0:
                raise RuntimeError(f"cuMemHostAlloc({nbytes}) failed: {err}")
            dev = ctypes.c_uint64()
            err = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dev), host, 0)
            if err != 0:
                raise RuntimeError(f"cuMemHostGetDevicePointer failed: {err}")
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        self.host = host.value or 0
        self.device_ptr = dev.value
        self.nbytes = nbytes
        self.used = 0
        self.view = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.host))

    def take(self, n: int) -> tuple[int, np.ndarray]:
        """A slice of `n` bytes: its GPU address and its host view."""
        at = self.used
        if at + n > self.nbytes:
            raise MemoryError(f"pinned arena full ({self.nbytes} bytes)")
        self.used = (at + n + 255) // 256 * 256
        return self.device_ptr + at, self.view[at:at + n]

    def reset(self) -> None:
        self.used = 0


def copy_to_host(block: mx.array, arena: PinnedArena) -> tuple[np.ndarray, mx.array]:
    """Queue the copy of `block`'s bytes (contiguous, any dtype) into a slice of `arena` on the
    side stream, behind whatever makes `block`; the slice and the copy's `done` (one uint32)."""
    global _kernel, _side
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="mlxd_copy_to_host", input_names=["src", "dst", "size"],
                                      output_names=["done"], source=_SOURCE)
        _side = mx.new_stream(mx.gpu)
    flat = block.reshape(-1).view(mx.uint8)
    n = flat.size
    address, host = arena.take(n)
    dst = mx.array([address & 0xFFFFFFFF, address >> 32], dtype=mx.uint32)
    size = mx.array([n & 0xFFFFFFFF, n >> 32], dtype=mx.uint32)
    (done,) = _kernel(inputs=[flat, dst, size], output_shapes=[(1,)], output_dtypes=[mx.uint32],
                      grid=(COPY_BLOCKS * 256, 1, 1), threadgroup=(256, 1, 1), stream=_side)
    return host, done


def wait(done: mx.array) -> None:
    """Block until the copy is made (MLX waits with the GIL released)."""
    if done.item() != 1:
        raise RuntimeError("copy kernel did not finish")


def _check() -> None:
    arena = PinnedArena(1 << 30)
    for mb in (1, 32, 600):
        n = mb * (1 << 20) // 2 + 3  # an odd tail too
        a = mx.random.randint(0, 1 << 15, (n,)).astype(mx.uint16)
        mx.eval(a)
        times = []
        for _ in range(3):
            arena.reset()
            t = time.perf_counter()
            host, done = copy_to_host(a, arena)
            mx.async_eval(done)
            wait(done)
            times.append(time.perf_counter() - t)
        same = np.array_equal(host.view(np.uint16)[:n], np.array(a))  # the host read last: it moves `a`
        print(f"{mb} MB: " + ", ".join(f"{t * 1000:.2f} ms ({a.nbytes / t / 1e9:.1f} GB/s)" for t in times)
              + f"; bytes equal: {same}", flush=True)
        if not same:
            sys.exit(1)
    a = mx.random.randint(0, 1 << 15, (1 << 20,)).astype(mx.uint16)
    arena.reset()
    host, done = copy_to_host(a[1:], arena)  # an offset view: 2 bytes off any alignment
    mx.async_eval(done)
    wait(done)
    same = np.array_equal(host.view(np.uint16), np.array(a)[1:])
    print(f"an offset view: bytes equal: {same}", flush=True)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    _check()
