"""A checkpoint's bytes to the host on CUDA without MLX reading them there.

Reading a GPU array on the host through MLX moves its buffer to managed memory: a
`cudaMallocManaged` and a synchronous copy on the reading thread, the GIL held, and a `cudaFree`
when the array goes (as MLX 0.32's CUDA allocator reads; CUDA documents `cudaFree` as waiting for
the device). At 8 streams that cost decode 3-6% with
checkpoints on, however the reads were spread (docs/benchmarks.md, issue 29). Here the host
memory is page-locked once (`cuMemHostAlloc`, mapped into the GPU's address space), and an MLX
custom kernel on a stream of its own writes each block's bytes straight into a slice of it, over
PCIe, behind whatever makes the block. Each of the kernel's thread blocks then sets its flag in
the same host memory; the writer thread waits for the flags before it reads the bytes. Nothing
but a kernel launch happens on the GPU thread, and no MLX call on the writer's.

`Copier.start` allocates the memory in a thread of its own (page-locking gigabytes takes a
while); until it is ready, `copy` answers None and the checkpoint goes the other way
(prefix_cache.READ_A_TURN). `MLXD_CHECKPOINT_PINNED_MB` sets the size (0: never)."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Any

import mlx.core as mx

from mlxd.engine.cache.kv_layout import Staged

log = logging.getLogger("mlxd.engine")

THREADS = 256
KERNEL_BLOCKS = 32  # thread blocks a copy: PCIe-bound, so a few SMs' worth taken from decode
FLAGS_BYTES = KERNEL_BLOCKS * 4
ALIGN = 256
MOST_BYTES = 8 << 30  # the default size's ceiling; at most an eighth of the host's memory too
WAIT_S = 120.0  # a copy not made by then: the GPU is gone or hung

_SOURCE = """
    unsigned long long base = ((unsigned long long)args[1] << 32) | (unsigned long long)args[0];
    unsigned long long n = ((unsigned long long)args[3] << 32) | (unsigned long long)args[2];
    unsigned long long flags = ((unsigned long long)args[5] << 32) | (unsigned long long)args[4];
    unsigned int seq = args[6];
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
    __syncthreads();
    if (threadIdx.x == 0 && flags != 0) {  // 0: the warm-up's copy of nothing
        reinterpret_cast<volatile unsigned int*>(flags)[blockIdx.x] = seq;
    }
    if (i == 0) {
        done[0] = seq;
    }
"""


class Unavailable(RuntimeError):
    """No CUDA driver, or it would not give page-locked memory."""


def default_bytes(cache_cap: int) -> int:
    """`MLXD_CHECKPOINT_PINNED_MB`, or the smallest of MOST_BYTES, an eighth of the host's memory
    and half the prompt cache's cap (checkpoints queued never hold more: prefix_cache.py)."""
    if (env := os.environ.get("MLXD_CHECKPOINT_PINNED_MB")) is not None:
        try:
            return max(0, int(env)) << 20
        except ValueError:
            log.warning("MLXD_CHECKPOINT_PINNED_MB=%r is not a whole number of MiB; the default is used", env)
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        host = 0
    return max(0, min(MOST_BYTES, host // 8, cache_cap // 2))


class Arena:
    """One page-locked, GPU-mapped host allocation, handed out in ALIGN-aligned slices (first
    fit; `give` from any thread)."""

    def __init__(self, memory: memoryview, device_ptr: int) -> None:
        self.memory = memory.cast("B") if memory.format != "B" else memory
        self.nbytes = self.memory.nbytes
        self.device_ptr = device_ptr  # where the GPU sees `memory`
        self._free = [(0, self.nbytes)]  # (start, size), in order of start
        self._lock = threading.Lock()

    @classmethod
    def pinned(cls, nbytes: int, device: int = 0) -> Arena:
        """`nbytes` of page-locked host memory from the CUDA driver, mapped for the GPU."""
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise Unavailable(f"no CUDA driver ({exc})") from exc
        if lib.cuInit(0) != 0:
            raise Unavailable("cuInit failed")
        ctx = ctypes.c_void_p()
        if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) != 0 or lib.cuCtxPushCurrent_v2(ctx) != 0:
            raise Unavailable("no CUDA context")
        try:
            host, dev = ctypes.c_void_p(), ctypes.c_uint64()
            if (err := lib.cuMemHostAlloc(ctypes.byref(host), ctypes.c_size_t(nbytes), 0x01 | 0x02)) != 0:
                raise Unavailable(f"cuMemHostAlloc({nbytes}) failed: {err}")  # PORTABLE | DEVICEMAP
            if (err := lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dev), host, 0)) != 0:
                lib.cuMemFreeHost(host)
                raise Unavailable(f"cuMemHostGetDevicePointer failed: {err}")
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        return cls(memoryview((ctypes.c_uint8 * nbytes).from_address(host.value or 0)), int(dev.value))

    def take(self, n: int) -> int | None:
        """The start of a free slice of at least `n` bytes, or None."""
        n = (n + ALIGN - 1) // ALIGN * ALIGN
        with self._lock:
            for k, (start, size) in enumerate(self._free):
                if size >= n:
                    self._free[k:k + 1] = [(start + n, size - n)] if size > n else []
                    return start
        return None

    def give(self, start: int, n: int) -> None:
        n = (n + ALIGN - 1) // ALIGN * ALIGN
        with self._lock:
            free = sorted([*self._free, (start, n)])
            merged: list[tuple[int, int]] = []
            for s, size in free:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((s, size))
            self._free = merged

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size in self._free)


class HostCopy:
    """One block's bytes on their way to a slice of the arena: `ready` once every thread block of
    its kernel has set its flag to `seq`."""

    def __init__(self, arena: Arena, at: int, n: int, seq: int) -> None:
        self._arena, self._at, self._n, self.seq = arena, at, n, seq
        self.bytes = arena.memory[at:at + n]
        self._flags = arena.memory[at + n + (-n % 16):][:FLAGS_BYTES].cast("I")
        for k in range(KERNEL_BLOCKS):  # the slice may hold an earlier copy's bytes: no stale flag
            self._flags[k] = 0

    @property
    def ready(self) -> bool:
        return all(f == self.seq for f in self._flags)

    def release(self) -> None:
        self.bytes = self._flags = memoryview(b"")
        self._arena.give(self._at, self._n + (-self._n % 16) + FLAGS_BYTES)


def wait(copies: list[HostCopy], timeout_s: float | None = None) -> bool:
    """Until every copy is made (the writer thread), polling; False after `timeout_s` (WAIT_S)."""
    deadline = time.monotonic() + (WAIT_S if timeout_s is None else timeout_s)
    pause = 0.0002
    for c in copies:
        while not c.ready:
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
    return True


def release(copies: list[HostCopy]) -> None:
    for c in copies:
        c.release()


class Copier:
    """The arena, once allocated, and the kernel that fills it (GPU thread)."""

    def __init__(self) -> None:
        self.arena: Arena | None = None
        self.failed: str | None = None
        self._seq = 0
        self._kernel: Any = None
        self._stream: Any = None

    @classmethod
    def start(cls, nbytes: int) -> Copier:
        """Allocate `nbytes` in a thread of its own; `copy` answers None until then."""
        copier = cls()

        def allocate() -> None:
            started = time.perf_counter()
            try:
                arena = Arena.pinned(nbytes)
            except Unavailable as exc:
                copier.failed = str(exc)
                log.warning("checkpoint copies: no page-locked host memory (%s); they are read the slow way", exc)
                return
            if copier.failed is None:  # the kernel did build
                copier.arena = arena
            log.info("checkpoint copies: %.1f GiB of page-locked host memory in %.2f s",
                     nbytes / (1 << 30), time.perf_counter() - started)

        threading.Thread(target=allocate, name="mlxd-pinned", daemon=True).start()
        if mx.cuda.is_available():
            try:
                copier.warm()
            except Exception as exc:
                copier._give_up(f"the copy kernel failed ({type(exc).__name__}: {exc})")
        return copier

    def copy(self, blocks: list[mx.array]) -> list[HostCopy] | None:
        """Queue each block's bytes (any dtype, made or lazy) into the arena, behind whatever
        makes it; None, queuing nothing, when the arena is not ready or too full for all."""
        arena = self.arena
        if arena is None or not blocks:
            return None
        taken: list[tuple[int, int]] = []
        for b in blocks:
            n = b.nbytes
            if (at := arena.take(n + (-n % 16) + FLAGS_BYTES)) is None:
                for start, size in taken:
                    arena.give(start, size + (-size % 16) + FLAGS_BYTES)
                return None
            taken.append((at, n))
        try:
            copies = [self._copy(b, arena, at, n) for b, (at, n) in zip(blocks, taken, strict=True)]
            mx.async_eval([done for _, done in copies])
        except Exception as exc:  # the kernel would not build or launch: never again, the other way
            self._give_up(f"the copy kernel failed ({type(exc).__name__}: {exc})")
            for start, size in taken:
                arena.give(start, size + (-size % 16) + FLAGS_BYTES)
            return None
        return [c for c, _ in copies]

    def _give_up(self, why: str) -> None:
        self.arena, self.failed = None, why
        log.warning("checkpoint copies: %s; they are read the slow way", why)

    def _copy(self, block: mx.array, arena: Arena, at: int, n: int) -> tuple[HostCopy, mx.array]:
        self._seq = self._seq % 0xFFFFFFFF + 1  # never 0, which its flags hold until set
        c = HostCopy(arena, at, n, self._seq)
        dst = arena.device_ptr + at
        flags = dst + n + (-n % 16)
        args = [dst & 0xFFFFFFFF, dst >> 32, n & 0xFFFFFFFF, n >> 32, flags & 0xFFFFFFFF, flags >> 32, c.seq]
        return c, self._launch(block.reshape(-1).view(mx.uint8), c, args)

    def _launch(self, flat: mx.array, c: HostCopy | None, args: list[int]) -> mx.array:
        """The kernel writing `flat`'s bytes to the arena, then its flags (`args`: where, how
        many, where the flags are, `c.seq`; all 0 for a copy of nothing)."""
        if self._kernel is None:
            self._kernel = mx.fast.cuda_kernel(name="mlxd_copy_to_host", input_names=["src", "args"],
                                               output_names=["done"], source=_SOURCE)
            self._stream = mx.new_stream(mx.gpu)
        (done,) = self._kernel(inputs=[flat, mx.array(args, dtype=mx.uint32)], output_shapes=[(1,)],
                               output_dtypes=[mx.uint32], grid=(KERNEL_BLOCKS * THREADS, 1, 1),
                               threadgroup=(THREADS, 1, 1), stream=self._stream)
        return done

    def warm(self) -> None:
        """Compile the kernel now (GPU thread, at start; 1.5-2.5 s on an H100 the first time), not
        at the first checkpoint, which would stall decode as long: a copy of nothing."""
        mx.eval(self._launch(mx.zeros((16,), dtype=mx.uint8), None, [0] * 7))


def queue(staged: Staged, copier: Copier | None) -> Staged:
    """A checkpoint's staged copy on its way (GPU thread): into page-locked memory where
    `copier` has room for all of it (its blocks then dropped: MLX holds them until copied), else
    made on the GPU, to be read to the host later (prefix_cache.send_checkpoints)."""
    if copier is not None and (host := copier.copy(staged.blocks)) is not None:
        return Staged(staged.meta, staged.tensors, [], host)
    mx.async_eval(staged.arrays)
    return staged
