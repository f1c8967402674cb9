"""Write a random-weight llama of a real model's shape, for GPU benchmarks (no download).

Shapes: `1b-bf16` (2048 wide, 16 layers, like Llama-3.2-1B) and `8b-4bit` (4096 wide, 32
layers, 4-bit, like Llama-3.1-8B at q4); `tiny-bf16` and `tiny-4bit` (256 wide, 2 layers) to try a script on a CPU;
`micro-f32` (64 wide, 2 layers, float32) for a client's long prompts on a CPU. The tokenizer files are copied from `--tokenizer`
(a model dir with tokenizer.json and tokenizer_config.json, e.g. SmolLM2's, 49152 tokens), so
prompts are tokenized as a real model's would be.

  python benchmarks/random_llama.py 1b-bf16 /tmp/models/llama-1b-bf16 --tokenizer DIR [--context 65536]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models import llama
from mlx_lm.utils import save_model

# hidden, layers, intermediate, heads, kv heads, bits (0: bf16)
SHAPES = {"1b-bf16": (2048, 16, 8192, 32, 8, 0), "8b-4bit": (4096, 32, 14336, 32, 8, 4),
          "8b-bf16": (4096, 32, 14336, 32, 8, 0), "tiny-bf16": (256, 2, 512, 4, 2, 0),
          "tiny-4bit": (256, 2, 512, 4, 2, 4),
          # Two heads of 32: a long prompt (an agent's 40k+ tokens) prefills in seconds on a CPU, in float32.
          "micro-f32": (64, 2, 128, 2, 1, 0)}


def build(shape: str, out: Path, tokenizer: Path, context: int = 32768) -> Path:
    hidden, layers, inter, heads, kv, bits = SHAPES[shape]
    vocab = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    config = {
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv, "rms_norm_eps": 1e-5, "vocab_size": vocab,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "max_position_embeddings": context,
        "torch_dtype": "float32" if shape.endswith("-f32") else "bfloat16",
    }
    dtype = mx.float32 if shape.endswith("-f32") else mx.bfloat16
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: (mx.random.normal(p.shape) * 0.02).astype(dtype), model.parameters()))
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
        config["quantization"] = {"group_size": 64, "bits": bits}
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    save_model(str(out), model)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, out / name)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out", type=Path)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--context", type=int, default=32768, help="the model's window (max_position_embeddings)")
    a = p.parse_args()
    print(build(a.shape, a.out, a.tokenizer, a.context))


if __name__ == "__main__":
    main()
