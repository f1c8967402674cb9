"""The engine's checkpoint copy on CUDA, checked alone: a GPU array's bytes copied into
page-locked host memory by a kernel on a stream of its own (mlxd/engine/cache/pinned.py), and
waited for by polling the kernel's flags in that memory, as the SSD tier's writer does.

Prints, for blocks of 1, 32 and 600 MB (an odd tail too) and for an offset view, the time from
queuing the copy to its flags all set, the rate, and whether the host bytes equal the array's;
exits 1 if any differ. CUDA only:

  python3 benchmarks/pinned_copy.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx
import numpy as np

from mlxd.engine.cache import pinned


def main() -> None:
    started = time.perf_counter()
    copier = pinned.Copier()
    copier.arena = pinned.Arena.pinned(1 << 30)
    print(f"1 GiB page-locked in {time.perf_counter() - started:.2f} s", flush=True)
    cases = [(f"{mb} MB", mx.random.randint(0, 1 << 15, (mb * (1 << 20) // 2 + 3,)).astype(mx.uint16))
             for mb in (1, 32, 600)]
    whole = mx.random.randint(0, 1 << 15, (1 << 20,)).astype(mx.uint16)
    cases.append(("an offset view (2 bytes off any alignment)", whole[1:]))
    for label, a in cases:
        mx.eval(a)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            copies = copier.copy([a])
            assert copies is not None, "the arena is full"
            if not pinned.wait(copies, 30):
                print(f"{label}: the copy never came", flush=True)
                sys.exit(1)
            times.append(time.perf_counter() - t)
            host = np.frombuffer(copies[0].bytes, dtype=np.uint16).copy()
            pinned.release(copies)
        same = np.array_equal(host, np.array(a))  # the array read on the host last: it moves `a`
        print(f"{label}: " + ", ".join(f"{t * 1000:.2f} ms ({a.nbytes / t / 1e9:.1f} GB/s)" for t in times)
              + f"; bytes equal: {same}", flush=True)
        if not same:
            sys.exit(1)
    print(f"arena free after: {copier.arena.free_bytes} of {copier.arena.nbytes}", flush=True)


if __name__ == "__main__":
    main()
