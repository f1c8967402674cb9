"""What a continuation's first step pays for KV restored from SSD, on CUDA (issue 29).

On an H100 the engine that took over a cut reply spent 76-94 ms in the continuation's first
turn, of which the tail prefill is only about 48 tokens (docs/benchmarks.md, "fifteenth
session"). MLX's CUDA allocator gives arrays made on the host (`mx.load`, the SSD tier's
restore) managed memory (`cudaMallocManaged`), and arrays a kernel makes device memory
(`cudaMallocAsync`): a restored entry's KV then moves to the card by page faults the first time
a kernel reads it. This probe times that alone, with KV of the 8B-shaped model's layout
(`--layers` of keys and values, `--kv-heads` x `--tokens` x `--head-dim`, bf16), read as the
first append of a KVCache reads it (a copy into a longer buffer, a `--tail` of new tokens):

- `device`: KV a kernel made (what the RAM tier holds of a live engine's rows);
- `loaded`: KV `mx.load` read from a safetensors file (what a restore holds), read by the GPU
  the first time;
- `loaded+copy`: the same, first copied by one GPU kernel per array (the copy's time shown
  apart: what moving it ahead of the continuation, at the engine's start, would cost there).

Rounds go device, loaded, loaded+copy (`--rounds`), each after a warm-up round of its own.

    python benchmarks/restore_copy_probe.py                      # 8B-shaped, 5,024 tokens: 658 MB
    python benchmarks/restore_copy_probe.py --layers 2 --tokens 512   # a quick look on the CPU
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx


def append(kv: list[mx.array], tail: int) -> float:
    """Milliseconds to append `tail` tokens to every array of `kv` (one GPU pass, evaluated)."""
    extra = mx.zeros((*kv[0].shape[:2], tail, kv[0].shape[3]), dtype=kv[0].dtype)
    mx.eval(extra)
    started = time.perf_counter()
    mx.eval([mx.concatenate([x, extra], axis=2) for x in kv])
    return (time.perf_counter() - started) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=5024)
    p.add_argument("--tail", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    shape = (1, a.kv_heads, a.tokens, a.head_dim)
    nbytes = 2 * a.layers * a.kv_heads * a.tokens * a.head_dim * 2
    print(f"device {mx.default_device()}; KV {2 * a.layers} arrays of {shape} bf16, {nbytes / 1e6:.0f} MB; "
          f"tail {a.tail}", flush=True)
    with tempfile.TemporaryDirectory(prefix="restore-probe-") as tmp:
        path = str(Path(tmp) / "kv.safetensors")
        made = {f"{i}": mx.random.normal(shape).astype(mx.bfloat16) for i in range(2 * a.layers)}
        mx.eval(list(made.values()))
        mx.save_safetensors(path, made)
        del made
        times: dict[str, list[float]] = {"device": [], "loaded": [], "loaded+copy": [], "copy": [], "load": []}
        for r in range(a.rounds + 1):
            for way in ("device", "loaded", "loaded+copy"):
                mx.clear_cache()
                if way == "device":
                    kv = [mx.random.normal(shape).astype(mx.bfloat16) for _ in range(2 * a.layers)]
                    mx.eval(kv)
                else:
                    started = time.perf_counter()
                    kv = list(mx.load(path).values())
                    mx.eval(kv)
                    load_ms = (time.perf_counter() - started) * 1000
                    if way == "loaded" and r:
                        times["load"].append(load_ms)
                    if way == "loaded+copy":
                        started = time.perf_counter()
                        kv = [mx.contiguous(x * 1) for x in kv]  # a kernel's output: device memory
                        mx.eval(kv)
                        if r:
                            times["copy"].append((time.perf_counter() - started) * 1000)
                took = append(kv, a.tail)
                if r:  # round 0 warms every kernel up
                    times[way].append(took)
                del kv
        for way, got in times.items():
            print(f"{way:12s} median {statistics.median(got):8.2f} ms  ({', '.join(f'{t:.2f}' for t in got)})",
                  flush=True)


if __name__ == "__main__":
    main()
