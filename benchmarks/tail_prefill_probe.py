"""What a continuation's first turn costs on a fresh engine, taken apart (issue 29).

On an H100 a fresh engine's first turn for a resumed reply (the 47 tokens after its checkpoint
prefilled over 5,024 cached ones, then the first new token) took 134, 95 and 74 ms for three
such continuations in a row, where a warm engine's decode step over that context is about 9 ms
(docs/benchmarks.md, issue 29, "sixteenth session"). This runs the serial lane's steps for such a
turn outside any engine: the model as the engine sets it up on CUDA (mlxd's attention), KV of
exactly `--cached` tokens (as the SSD tier's restore and the RAM tier hold it: a buffer with no
room to grow, so the first append copies it), then the tail as one chunk (evaluated; MLX's buffer
cache cleared after it, as the serial lane does) and one decode step, with MLX's settings as an
engine has them (mlx_env.py: CUDA graphs off). Each trial's KV is kept
afterwards, as the prompt cache keeps each ended reply's. Ways, alternated:

- `lane`: the serial lane's steps as they are, the CUDA memory pool trimmed to nothing first
  (what an engine does once before it serves: device_memory.release_unused) and left at its
  release threshold;
- `keep`: the same without `mx.clear_cache()` after the chunk;
- `grown`: as `lane`, the CUDA pool told to keep what it reserves (a release threshold of all
  the card) and grown by `--grow` GiB beforehand;
- `grownkeep`: both.

Also the time to allocate (and evaluate) 700 MB fresh from a trimmed pool against from a grown one.

    python3 benchmarks/tail_prefill_probe.py --model /tmp/models/l8q
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxd.engine import mlx_env  # noqa: E402

mlx_env.apply()  # MLX's settings as an engine has them (CUDA graphs off, ...), before mlx is imported
import mlx.core as mx  # noqa: E402

RELEASE_THRESHOLD = 4  # CUmemPool_attribute


def pool() -> tuple[Any, ctypes.c_void_p] | None:
    """The driver (cuda_memory.py's) and device 0's default memory pool; None off CUDA."""
    from mlxd.engine.gpu.cuda_memory import _driver

    lib = _driver()
    handle = ctypes.c_void_p()
    return (lib, handle) if lib is not None and lib.cuDeviceGetDefaultMemPool(ctypes.byref(handle), 0) == 0 else None


def threshold(p: tuple[Any, ctypes.c_void_p] | None, value: int | None = None) -> int | None:
    """The pool's release threshold (set to `value` first, if given)."""
    if p is None:
        return None
    lib, handle = p
    v = ctypes.c_uint64(value or 0)
    if value is not None:
        lib.cuMemPoolSetAttribute(handle, RELEASE_THRESHOLD, ctypes.byref(v))
    lib.cuMemPoolGetAttribute(handle, RELEASE_THRESHOLD, ctypes.byref(v))
    return v.value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--cached", type=int, default=5024)
    p.add_argument("--tail", type=int, default=48, help="tokens after the cached ones (the last one is the decode step's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ways", default="lane,keep,grown,grownkeep")
    p.add_argument("--gap", type=float, default=0.5, help="seconds the GPU idles before each trial (a client's pause)")
    p.add_argument("--grow", type=float, default=8.0)
    a = p.parse_args()

    from mlx_lm.models.cache import KVCache, make_prompt_cache
    from mlx_lm.utils import load

    from mlxd.engine.gpu import decode_attention, prefill_attention
    from mlxd.engine.gpu.cuda_memory import cuda_memory, trim_pool

    model, _ = load(a.model)
    if mx.cuda.is_available():
        decode_attention.install(model)
        prefill_attention.aligned_chunk = 2048
    vocab = model.args.vocab_size
    tokens = [(i * 7919) % (vocab - 3) + 3 for i in range(a.cached + a.tail)]
    kv = make_prompt_cache(model)
    for start in range(0, a.cached, 2048):
        model(mx.array(tokens[start:min(start + 2048, a.cached)])[None], cache=kv)
        mx.eval([c.state for c in kv])
    base = [(mx.contiguous(c.keys[..., : a.cached, :]), mx.contiguous(c.values[..., : a.cached, :])) for c in kv]
    mx.eval(base)
    del kv
    mx.clear_cache()
    cp = pool()
    default = threshold(cp)
    print(f"device {mx.default_device()}; KV of {a.cached} tokens, {sum(k.nbytes + v.nbytes for k, v in base) / 1e6:.0f} MB; "
          f"tail {a.tail}; CUDA pool {'found, release threshold ' + str(default) if cp else 'none'}", flush=True)

    def fresh() -> list[KVCache]:
        out = []
        for k, v in base:
            c = KVCache()
            c.keys, c.values, c.offset = k, v, a.cached
            out.append(c)
        return out

    kept: list[list[KVCache]] = []

    def trial(clear: bool) -> tuple[float, float]:
        c = fresh()
        t0 = time.perf_counter()
        model(mx.array(tokens[a.cached: a.cached + a.tail - 1])[None], cache=c)
        mx.eval([x.state for x in c])
        if clear:
            mx.clear_cache()
        t1 = time.perf_counter()
        logits = model(mx.array(tokens[a.cached + a.tail - 1:])[None], cache=c)
        int(mx.argmax(logits[0, -1]).item())
        t2 = time.perf_counter()
        kept.append(c)
        return (t1 - t0) * 1000, (t2 - t1) * 1000

    def alloc_ms() -> float:
        t0 = time.perf_counter()
        x = mx.zeros((700 * 2**20 // 2,), dtype=mx.bfloat16)
        mx.eval(x)
        took = (time.perf_counter() - t0) * 1000
        del x
        return took

    def trimmed() -> None:
        """The pool as an engine leaves it before it serves: what is unused handed back."""
        kept.clear()
        mx.clear_cache()
        threshold(cp, default)
        trim_pool()

    def grown() -> None:
        """The pool told to keep what it reserves, and grown by --grow GiB."""
        threshold(cp, 2**63)
        big = mx.zeros((int(a.grow * 2**30) // 2 // 4096, 4096), dtype=mx.bfloat16)  # 2-D: a shape dimension is an int32
        mx.eval(big)
        del big
        mx.clear_cache()

    trial(True)  # kernels compiled
    kept.clear()
    ways = a.ways.split(",")
    got: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    allocs: dict[str, list[float]] = {"trimmed pool": [], "grown pool": []}
    for r in range(a.rounds):
        for way in ways:
            trimmed()
            if way.startswith("grown"):
                grown()
            times = []
            for _ in range(3):  # three continuations in a row, as the probe sent them
                time.sleep(a.gap)
                times.append(trial(not way.endswith("keep")))
            got[way].extend(times)
            print(f"round {r} {way:9s}: " + "; ".join(f"chunk {c:.1f} + step {s:.1f} = {c + s:.1f} ms" for c, s in times)
                  + f"  (pool {((cuda_memory() or {}).get('pool_reserved', 0)) / 2**30:.1f} GiB reserved)", flush=True)
        trimmed()
        allocs["trimmed pool"].append(alloc_ms())
        grown()
        allocs["grown pool"].append(alloc_ms())
        threshold(cp, default)
    for way, ts in got.items():
        totals = [c + s for c, s in ts]
        print(f"{way:8s} median {statistics.median(totals):7.1f} ms (chunk {statistics.median(c for c, _ in ts):.1f}, "
              f"step {statistics.median(s for _, s in ts):.1f}); all {', '.join(f'{t:.0f}' for t in totals)}", flush=True)
    for name, ts in allocs.items():
        print(f"700 MB from a {name}: {', '.join(f'{t:.1f}' for t in ts)} ms", flush=True)


if __name__ == "__main__":
    main()
