"""Unfused prefill attention whole against a block of queries at a time (prefill_attention.py's
UNFUSED_SCORE_BYTES): peak memory and time of one layer's attention at a batch lane's prefill
chunk, and that both give the same output.

    python benchmarks/unfused_blocks.py                      # 8 rows x 2048 queries over 4574 keys, 8B heads
    python benchmarks/unfused_blocks.py --rows 1 --keys 8192

Random bf16 queries, keys and values; the mask is the batch lane's (causal, each row's prompt
left-padded by a different amount). Each timing is the median of --runs evaluations after one
unmeasured (kernels are compiled on first use of each shape).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mlxd.engine.gpu import prefill_attention as pa


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--queries", type=int, default=2048)
    p.add_argument("--keys", type=int, default=4574)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args()
    kq, kk, kv = mx.random.split(mx.random.key(0), 3)
    q = mx.random.normal((a.rows, a.heads, a.queries, a.dim), key=kq).astype(mx.bfloat16)
    k = mx.random.normal((a.rows, a.kv_heads, a.keys, a.dim), key=kk).astype(mx.bfloat16)
    v = mx.random.normal((a.rows, a.kv_heads, a.keys, a.dim), key=kv).astype(mx.bfloat16)
    causal = mx.arange(a.keys - a.queries, a.keys)[:, None] >= mx.arange(a.keys)[None]
    padding = mx.array([i * 37 for i in range(a.rows)])[:, None, None, None]
    mask = causal[None, None] & (mx.arange(a.keys)[None, None, None, :] >= padding)
    mx.eval(q, k, v, mask)
    scale = a.dim ** -0.5
    whole_bytes = a.rows * a.heads * a.queries * a.keys * 4
    results: dict[str, dict[str, float]] = {}
    outputs = {}
    for name, limit in (("whole", whole_bytes + 1), ("blocks", pa.UNFUSED_SCORE_BYTES)):
        pa.UNFUSED_SCORE_BYTES = limit
        mx.eval(pa.unfused(q, k, v, scale, mask))  # compile
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        times = []
        for _ in range(a.runs):
            started = time.perf_counter()
            out = pa.unfused(q, k, v, scale, mask)
            mx.eval(out)
            times.append(time.perf_counter() - started)
        outputs[name] = out
        results[name] = {"peak_above_inputs_gib": round((mx.get_peak_memory() - base) / 1024**3, 3),
                         "ms": round(statistics.median(times) * 1000, 2)}
        print(name, results[name], flush=True)
    same = mx.allclose(outputs["whole"].astype(mx.float32), outputs["blocks"].astype(mx.float32), atol=2e-2).item()
    print(json.dumps({"device": str(mx.default_device()), "shape": vars(a), **results, "same_output": same,
                      "blocks_over_whole_ms": round(results["blocks"]["ms"] / results["whole"]["ms"], 3),
                      "blocks_over_whole_peak": round(results["blocks"]["peak_above_inputs_gib"]
                                                      / results["whole"]["peak_above_inputs_gib"], 3)}, indent=2))


if __name__ == "__main__":
    main()
