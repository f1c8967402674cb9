"""A model that ends every reply at once, for checking a client's protocol handling.

Real agent clients (Claude Code, Codex) send prompts of 9,000-20,000 tokens, which only a
model with a large window holds; on a machine without one, a random-weight llama with a 32k
window (random_llama.py) holds them, but never samples its end token, so a turn never ends.
This copies such a model dir and rewrites three tensors so that its first token is always
EOS: the embedding puts 10 in one dimension of every token, the final norm keeps only that
dimension, and the output head maps it to EOS alone. Replies are empty, but every request,
stream and usage count is real.

  python benchmarks/random_llama.py tiny-bf16 /tmp/tinym --tokenizer DIR   # DIR: SmolLM2's, say
  python benchmarks/eos_model.py /tmp/tinym /tmp/eosm
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, help="an MLX llama model dir (unquantized)")
    p.add_argument("dst", type=Path)
    a = p.parse_args()
    shutil.copytree(a.src, a.dst, dirs_exist_ok=True)
    weights = mx.load(str(a.src / "model.safetensors"))
    assert isinstance(weights, dict)
    config = json.loads((a.src / "tokenizer_config.json").read_text())
    vocab = json.loads((a.src / "tokenizer.json").read_text())["model"]["vocab"]
    eos = vocab[config["eos_token"]]
    dim = 0
    embed = weights["model.embed_tokens.weight"]
    embed = embed.astype(mx.float32)
    embed[:, dim] = 10.0
    weights["model.embed_tokens.weight"] = embed.astype(weights["model.embed_tokens.weight"].dtype)
    norm = mx.zeros_like(weights["model.norm.weight"])
    norm[dim] = 1.0
    weights["model.norm.weight"] = norm
    head = mx.zeros_like(weights["lm_head.weight"])
    head[eos, dim] = 1.0
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(a.dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    print(f"{a.dst}: every reply ends at once with token {eos} ({config['eos_token']})")


if __name__ == "__main__":
    main()
