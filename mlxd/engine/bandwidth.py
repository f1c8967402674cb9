"""This machine's memory bandwidth as a decode step sees it, measured once and kept.

`python -m mlxd.engine.bandwidth --out FILE` builds random llamas in memory (no file is read:
512 wide and 12 layers deep, then 2048 wide and 8 layers in bf16 on a GPU, 1024 wide and 4
layers in float32 on the CPU, as mlxd's imports make them there), prefills 256 tokens in each,
and times greedy decode steps the way mlx-lm's generate_step runs them (each step queued
before the previous token is read), the median of 3 runs of about half a second. A step takes
a cost per layer (kernel launches, the small operations between matmuls, the host's work) and
its bytes over the bandwidth (every weight but the embedding table, and the KV so far); the two
models' steps give both. A model's predicted decode speed is made
from them (protocol/fit.py). It writes one JSON object to FILE
(written whole, then renamed) and prints it. The supervisor runs it the first time something
asks for the library (supervisor/library.py) and again when MLX's version changes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from mlxd.engine import blas, mlx_env
from mlxd.protocol.fit import PROBE_VERSION

PREFILL = 256
RUN_S = 0.5  # a timed run's length: 4 to 32 steps (a slow CPU's steps take 100 ms and more)
RUNS = 3


def measure() -> dict[str, Any]:
    import mlx.core as mx

    gpu = mx.default_device().type == mx.DeviceType.gpu
    dtype = mx.bfloat16 if gpu else mx.float32
    wide, layers = (2048, 8) if gpu else (1024, 4)
    shapes = [(512, 12), (wide, layers)]  # narrow and deep, wide and shallow: a layer's own cost, and the bandwidth
    timed = [time_steps(hidden, depth, dtype) for hidden, depth in shapes]
    (a, ba), (b, bb) = timed
    per_layer, inverse = solve(((12.0, ba, a), (float(layers), bb, b)))
    if inverse <= 0 or per_layer < 0:  # noise won: read the wide model's steps alone
        per_layer, inverse = 0.0, b / bb
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return {
        "version": PROBE_VERSION, "bandwidth_bytes_s": round(1 / inverse), "layer_overhead_s": round(per_layer, 7),
        "steps_ms": [round(t * 1000, 3) for t, _ in timed], "bytes_per_step": [n for _, n in timed],
        "device": "cpu" if not gpu else "cuda" if mx.cuda.is_available() else "metal",
        "device_name": str(info.get("device_name") or info.get("architecture") or ""),
        "mlx": importlib.metadata.version("mlx"),
        "probe": f"random llamas {', '.join(f'{h}x{d}' for h, d in shapes)} {str(dtype).split('.')[-1]}, decode "
                 f"steps after a {PREFILL}-token prompt",
        "measured_at": round(time.time(), 3),
    }


def solve(rows: tuple[tuple[float, float, float], tuple[float, float, float]]) -> tuple[float, float]:
    """(x, y) with x*r[0] + y*r[1] = r[2] for both rows."""
    (a1, b1, c1), (a2, b2, c2) = rows
    d = a1 * b2 - a2 * b1 or 1e-30
    return (c1 * b2 - c2 * b1) / d, (a1 * c2 - a2 * c1) / d


def time_steps(hidden: int, layers: int, dtype: Any) -> tuple[float, int]:
    """(median seconds a decode step of a random llama `hidden` wide and `layers` deep takes,
    the bytes it reads)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    config = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
              "num_attention_heads": hidden // 64, "num_key_value_heads": max(1, hidden // 256),
              "intermediate_size": hidden * 11 // 4, "vocab_size": 8192, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False}
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    params: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    mx.eval([p for _, p in params])
    weights = sum(p.nbytes for name, p in params if "embed_tokens" not in name)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, 8192, (1, PREFILL)), cache=cache))

    def step(token: Any) -> Any:
        return mx.argmax(model(token.reshape(1, 1), cache=cache)[:, -1, :], axis=-1)

    def run(n: int) -> float:
        y = step(mx.array([1]))
        mx.async_eval(y)
        started = time.perf_counter()
        for _ in range(n):
            nxt = step(y)
            mx.async_eval(nxt)
            y.item()
            y = nxt
        y.item()
        return (time.perf_counter() - started) / (n + 1)

    run(2)  # kernels compiled, buffers allocated
    steps = max(4, min(32, int(RUN_S / run(4))))
    step_s = statistics.median(run(steps) for _ in range(RUNS))
    kv_per_token = 2 * layers * max(1, hidden // 256) * 64 * dtype.size
    context = PREFILL + 8 + RUNS * (steps + 1) // 2  # the KV a step reads, on average over the runs
    return step_s, weights + kv_per_token * context


def main() -> None:
    blas.reexec_with_openblas(["-m", "mlxd.engine.bandwidth", *sys.argv[1:]])
    mlx_env.apply()  # before mlx is imported, as for an engine
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    args = parser.parse_args()
    found = measure()
    text = json.dumps(found)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, args.out)
    print(text)


if __name__ == "__main__":
    main()
