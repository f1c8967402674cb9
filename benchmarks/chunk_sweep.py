"""What a prefill chunk of M tokens over a long cached context costs, by M (issue 29).

A resumed reply's first turn prefills the tokens after its checkpoint (1 to 511 at checkpoints
512 apart) over the KV of all before them, then takes one decode step. This times one forward of
M tokens over `--cached` tokens of KV (the offset put back after each, so every call sees the same
context), `--repeats` times for each M in `--sizes`, in one process, with MLX's settings as an
engine has them and, on CUDA, mlxd's attention routing. The first call of each M shows what a new
shape costs the first time in a process (kernels loaded or compiled); the rest, its steady cost.

  python3 benchmarks/chunk_sweep.py --model /tmp/models/l8q
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxd.engine import mlx_env  # noqa: E402

mlx_env.apply()  # before mlx is imported: MLX reads its settings once
import mlx.core as mx  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--cached", type=int, default=5024)
    p.add_argument("--sizes", default="1,2,4,8,16,24,32,40,47,48,56,64,96,128,256,512")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--chunk", type=int, default=2048, help="the chunk the cached context is prefilled in")
    a = p.parse_args()
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from mlxd.engine.gpu import decode_attention, prefill_attention

    model, _ = load(a.model)
    if mx.cuda.is_available():
        decode_attention.install(model)
        prefill_attention.aligned_chunk = a.chunk
    vocab = model.args.vocab_size
    sizes = [int(x) for x in a.sizes.split(",")]
    tokens = [(i * 7919) % (vocab - 3) + 3 for i in range(a.cached + max(sizes))]
    kv = make_prompt_cache(model)
    for start in range(0, a.cached, a.chunk):
        model(mx.array(tokens[start:min(start + a.chunk, a.cached)])[None], cache=kv)
        mx.eval([c.state for c in kv])
    print(f"device {mx.default_device()}; {a.cached} tokens cached; ms per forward of M tokens over them "
          f"(the first call of each M first)", flush=True)
    for m in sizes:
        took = []
        for _ in range(a.repeats):
            for c in kv:
                c.offset = a.cached
            t0 = time.perf_counter()
            out = model(mx.array(tokens[a.cached:a.cached + m])[None], cache=kv)
            mx.eval(out, [c.state for c in kv])
            took.append((time.perf_counter() - t0) * 1000)
        print(f"M {m:4}: " + " ".join(f"{x:.1f}" for x in took), flush=True)


if __name__ == "__main__":
    main()
