"""Write a target model built from a draft model: its layers, then near-identity copies (no download).

Random-weight models of different shapes agree on almost no token, so a random 1B draft tells
nothing about what a draft model buys an 8B target. This builds a target that a draft agrees
with most of the time and that costs several times as much a step: the draft's own layers
(with a little noise), then `--depth - 1` more copies of them whose output projections
(attention's o_proj and the MLP's down_proj) are scaled by `--residual`, so each adds only a
small change to the residual stream. Embedding, final norm and head are the draft's. Works on
bf16 and quantized llama-family models (a quantized projection is scaled through its scales
and biases).

  python benchmarks/deepened_model.py /tmp/models/l1b /tmp/models/l1b-x4 --depth 4 --residual 0.05
  python benchmarks/speculative.py --model /tmp/models/l1b-x4 --draft /tmp/models/l1b --workloads prose
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

PROJECTIONS = ("self_attn.o_proj.", "mlp.down_proj.")


def deepen(src: Path, dst: Path, depth: int, residual: float, noise: float, seed: int) -> Path:
    config = json.loads((src / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    weights: dict[str, mx.array] = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(mx.load(str(f)))  # type: ignore[arg-type]
    mx.random.seed(seed)
    out: dict[str, mx.array] = {}
    prefix = "model.layers."
    for name, w in weights.items():
        if not name.startswith(prefix):
            out[name] = w
            continue
        index, _, rest = name[len(prefix):].partition(".")
        for copy in range(depth):
            value = w
            packed = w.dtype == mx.uint32  # a quantized projection's packed ints: scaled through its scales/biases
            if copy and rest.startswith(PROJECTIONS) and not packed:
                value = (w.astype(mx.float32) * residual).astype(w.dtype)
            if noise and mx.issubdtype(value.dtype, mx.floating) and value.ndim == 2:
                value = (value.astype(mx.float32) * (1 + noise * mx.random.normal(value.shape))).astype(value.dtype)
            out[f"{prefix}{int(index) + copy * layers}.{rest}"] = value
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), out, metadata={"format": "mlx"})
    config["num_hidden_layers"] = layers * depth
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    print(f"{dst}: {layers * depth} layers ({layers} of {src.name}, then {depth - 1} near-identity copies), "
          f"{sum(v.nbytes for _, v in tree_flatten(out)) / 1e9:.2f} GB")
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, help="the draft model's dir")
    p.add_argument("dst", type=Path)
    p.add_argument("--depth", type=int, default=4, help="the target's layers, in copies of the draft's")
    p.add_argument("--residual", type=float, default=0.05, help="scale of the copies' output projections")
    p.add_argument("--noise", type=float, default=0.01, help="relative noise on every 2-D float weight")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    deepen(a.src, a.dst, a.depth, a.residual, a.noise, a.seed)


if __name__ == "__main__":
    main()
