"""Where an SSD-tier restore's time goes, and what a faster read would give (issue 29).

A resume after an engine crash restores its checkpoint from the SSD tier before it prefills the
few tokens after it; on an H100 that restore (663 MB for an 8B model's 4,574-token prompt) took
190-230 ms, a third of the prompt's cold prefill. This writes one KV file of that shape the way
the tier does (kv_files.write_file), then times, in alternating rounds with the file in the page
cache (as after a crash: the dead engine wrote it moments before):

- `tier`: SsdTier.restore, the engine's path (MLX's loader, the checksum in a thread beside it);
- `mlx_load`: mlx-lm's load_prompt_cache and its evaluation alone;
- `verify`: the checksum pass alone (kv_files.verify);
- `read_copy`: the file read into one host buffer, then each tensor made an MLX array from it.

After each, `touch` times a reduction over every array (on CUDA the first kernel that reads
memory the loader filled from the host). Prints the medians.

    python benchmarks/restore_probe.py [--tokens 4574 --layers 32 --kv-heads 8 --dim 128 --runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, load_prompt_cache

from mlxd.engine.cache import kv_files
from mlxd.engine.cache.kv_layout import tensors_of
from mlxd.engine.cache.ssd_tier import SsdTier

NP_OF = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "I32": np.int32, "I64": np.int64,
         "U8": np.uint8, "U16": np.uint16, "U32": np.uint32, "BOOL": np.uint8}


def make_file(root: Path, tokens: int, layers: int, kv_heads: int, dim: int) -> tuple[Path, int]:
    kv = []
    for i in range(layers):
        c = KVCache()
        k = mx.random.normal((1, kv_heads, tokens, dim), key=mx.random.key(i)).astype(mx.bfloat16)
        c.update_and_fetch(k, k * 0.5)
        kv.append(c)
    mx.eval([c.keys for c in kv])
    meta, tensors, _keep = tensors_of(kv)
    name = "probe" + kv_files.SUFFIX
    size = kv_files.write_file(root, name, list(range(tokens)), meta, tensors)
    return root / name, size


def read_copy(path: Path) -> list[mx.array]:
    """The file into one host buffer, then every tensor an MLX array copied from its slice."""
    header = kv_files.read_header(path)
    buf = np.empty(header.data_size, dtype=np.uint8)
    with open(path, "rb") as f:
        f.seek(header.data_start)
        f.readinto(memoryview(buf))
    out = []
    for entry in header.index.values():
        start, end = (int(x) for x in entry["data_offsets"])
        dtype = entry["dtype"]
        a = mx.array(buf[start:end].view(NP_OF.get(dtype, np.uint8)).reshape(entry["shape"]))
        out.append(a.view(mx.bfloat16) if dtype == "BF16" else a)
    mx.eval(out)
    return out


def arrays_of(cache: list[Any]) -> list[mx.array]:
    return [x for c in cache for x in (c.keys, c.values) if isinstance(x, mx.array)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4574)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    print(f"device: {mx.default_device()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path, size = make_file(root, args.tokens, args.layers, args.kv_heads, args.dim)
        print(f"file: {size / 1e6:.0f} MB ({args.tokens} tokens, {args.layers} layers)", flush=True)
        tier = SsdTier(root, 1 << 40)
        (entry,) = tier.entries()

        def tier_restore() -> list[mx.array]:
            cache = tier.restore(entry)
            assert cache is not None, "the probe's file did not restore"
            return arrays_of(cache)

        def mlx_load() -> list[mx.array]:
            out = arrays_of(load_prompt_cache(str(path)))
            mx.eval(out)
            return out

        def verify() -> list[mx.array]:
            kv_files.verify(path)
            return []

        ways = {"tier": tier_restore, "mlx_load": mlx_load, "verify": verify, "read_copy": lambda: read_copy(path)}
        times: dict[str, list[float]] = {w: [] for w in ways}
        touches: dict[str, list[float]] = {w: [] for w in ways}
        for way in ways.values():  # once each, untimed: the page cache, MLX's kernels
            mx.eval([mx.sum(a) for a in way()])
        for r in range(args.runs):
            for w, way in ways.items():
                t0 = time.perf_counter()
                arrays = way()
                t1 = time.perf_counter()
                if arrays:
                    mx.eval([mx.sum(a.astype(mx.float32)) for a in arrays])
                times[w].append(t1 - t0)
                touches[w].append(time.perf_counter() - t1)
                del arrays
            print(f"round {r + 1}: " + ", ".join(f"{w} {times[w][-1] * 1000:.0f}+{touches[w][-1] * 1000:.0f}"
                                                 for w in ways), flush=True)
        print(f"\nmedians of {args.runs} ({size / 1e6:.0f} MB): load + first touch, ms")
        for w in ways:
            t, u = statistics.median(times[w]) * 1000, statistics.median(touches[w]) * 1000
            print(f"  {w:10s} {t:7.1f} + {u:6.1f} = {t + u:7.1f}   ({size / 1e6 / max(t, 1e-9):.1f} GB/s load)")


if __name__ == "__main__":
    main()
