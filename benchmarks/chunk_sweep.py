"""What a prefill chunk of M tokens over a long cached context costs, by M (issue 29).

A resumed reply's first turn prefills the tokens after its checkpoint (1 to 511 at checkpoints
512 apart) over the KV of all before them, then takes one decode step. This times one forward of
M tokens over `--cached` tokens of KV (the offset put back after each, so every call sees the same
context), `--repeats` times for each M in `--sizes`, in one process, with MLX's settings as an
engine has them and, on CUDA, mlxd's attention routing. The first call of each M shows what a new
shape costs the first time in a process (kernels loaded or compiled); the rest, its steady cost.

`--ways plain,dequant` times each M twice over: `plain` as the model runs (MLX's quantized matmul),
`dequant` with each quantized linear layer's weights dequantized to the activations' dtype and
multiplied by MLX's dense matmul for inputs of 2 rows or more (a way to run a short chunk, where
MLX's quantized kernel for a few rows reads the weights slowly). Each way prints its MLX peak and
how far its outputs' last-position logits are from plain's. Each M is timed with the last
position's logits (as the pass that makes a first token) and without (a prefill chunk: only the
KV is evaluated, so MLX never computes the logits), so a prompt's last chunk and its first token
in one pass of M can be set against a chunk of M - 1 and a step of 1.

  python3 benchmarks/chunk_sweep.py --model /tmp/models/l8q
  python3 benchmarks/chunk_sweep.py --model /tmp/models/l8q --ways plain,dequant --sizes 1,8,47,48,512,2048
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxd.engine import mlx_env  # noqa: E402

mlx_env.apply()  # before mlx is imported: MLX reads its settings once
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--cached", type=int, default=5024)
    p.add_argument("--sizes", default="1,2,4,8,16,24,32,40,47,48,56,64,96,128,256,512")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--chunk", type=int, default=2048, help="the chunk the cached context is prefilled in")
    p.add_argument("--ways", default="plain", help="plain, dequant, or both (comma-separated)")
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
    last: dict[int, mx.array] = {}  # plain's last-position logits by M

    def forward(m: int, logits: bool) -> tuple[float, mx.array | None]:
        for c in kv:
            c.offset = a.cached
        t0 = time.perf_counter()
        out = model(mx.array(tokens[a.cached:a.cached + m])[None], cache=kv)
        row = out[0, -1].astype(mx.float32) if logits else None
        mx.eval([c.state for c in kv], *([row] if row is not None else []))
        return (time.perf_counter() - t0) * 1000, row

    for way in a.ways.split(","):
        set_way(way)
        mx.reset_peak_memory()
        print(f"-- {way}: per M, the forward with the last position's logits (as a first token is made), "
              f"then without logits (as a prefill chunk is: the KV only), each --repeats times, alternating",
              flush=True)
        for m in sizes:
            with_logits, kv_only, row = [], [], None
            for _ in range(a.repeats):
                took, row = forward(m, True)
                with_logits.append(took)
                kv_only.append(forward(m, False)[0])
            assert row is not None
            far = ""
            if way == "plain":
                last[m] = row
            elif m in last:
                diff = float(mx.max(mx.abs(row - last[m])).item())
                same = int(mx.argmax(row).item()) == int(mx.argmax(last[m]).item())
                far = f"   max |logit - plain's| {diff:.4f}, argmax {'same' if same else 'differs'}"
            print(f"M {m:4}: logits " + " ".join(f"{x:.1f}" for x in with_logits)
                  + " | kv only " + " ".join(f"{x:.1f}" for x in kv_only)
                  + f" | medians of the rest {statistics.median(with_logits[1:] or with_logits):.1f}"
                  + f" / {statistics.median(kv_only[1:] or kv_only):.1f}" + far, flush=True)
        print(f"   peak {mx.get_peak_memory() / 2**30:.2f} GiB", flush=True)


_plain_call = nn.QuantizedLinear.__call__


def _dequant_call(self: nn.QuantizedLinear, x: mx.array) -> mx.array:
    if x.size // x.shape[-1] < 2:
        return _plain_call(self, x)
    w = mx.dequantize(self["weight"], self["scales"], self.get("biases"), group_size=self.group_size,
                      bits=self.bits, mode=self.mode).astype(x.dtype)
    y = x @ w.T
    return y + self["bias"] if "bias" in self else y


def set_way(way: str) -> None:
    if way not in ("plain", "dequant"):
        raise SystemExit(f"unknown way {way!r}: plain or dequant")
    nn.QuantizedLinear.__call__ = _plain_call if way == "plain" else _dequant_call  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
