"""The one-launch LoRA kernel inside a model (NVIDIA GPU): a decode-shaped forward pass whose 8
rows run under different adapters gives the same logits with the kernel (its grouped q/k/v and
gate/up launches included) as with the MLX ops; so do passes whose rows all run under one stack.

  python benchmarks/lora_kernel_model_check.py --model /tmp/models/l1b

Random adapters at mlx-lm's defaults (rank 8, every linear layer of the last 16 layers) are
built in a temp dir and mounted on the model through mlxd's AdapterBank, as the engine does.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_lm.utils import load

from mlxd.engine.models import lora_kernel
from mlxd.engine.models.adapter_bank import AdapterBank
from mlxd.engine.models.random_adapter import build_random_adapter


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    args = p.parse_args()
    assert lora_kernel.usable(), "needs MLX on an NVIDIA GPU"
    model, _ = load(str(args.model))
    bank = AdapterBank(model)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(3):
            path = build_random_adapter(args.model, Path(tmp) / f"a{i}", seed=i, strength=0.05, keys=None)
            bank.mount(f"a{i}", path)
        stacks = [bank.resolve(spec) for spec in ("a0", "a1", "none", "a2", "a0+a1", "a1", "none", "a2")]
        tokens = mx.array([[11 + 7 * i] for i in range(len(stacks))])
        logits = {}
        for fused in (True, False):
            bank.fused = fused
            with bank.rows(stacks):
                logits[fused] = model(tokens).astype(mx.float32)
            mx.eval(logits[fused])
        logits["base"] = model(tokens).astype(mx.float32)  # no plan: the base model
    diff = mx.max(mx.abs(logits[True] - logits[False])).item()
    # What the adapters do, per row: the kernel must reproduce it, not merely stay near the base.
    moved = mx.max(mx.abs(logits[False] - logits["base"]), axis=(1, 2))
    kernel_moved = mx.max(mx.abs(logits[True] - logits["base"]), axis=(1, 2))
    print(f"max |kernel - ops| {diff:.5f}; per row, ops - base: {[round(v, 4) for v in moved.tolist()]}; "
          f"kernel - base: {[round(v, 4) for v in kernel_moved.tolist()]}")
    adapted = [i for i, s in enumerate(stacks) if s]
    assert all(moved[i].item() > 20 * diff for i in adapted), "the adapters must move the logits far more than the error"
    assert all(moved[i].item() == 0 for i, s in enumerate(stacks) if not s)
    # Every row under one stack (a lone stream before its merged copy): the kernel with each row
    # in slot 0 against the MLX ops.
    for spec in ("a2", "a0+a1"):
        one = {}
        for fused in (True, False):
            bank.fused = fused
            with bank.one(bank.resolve(spec)):
                one[fused] = model(tokens[:3]).astype(mx.float32)
            mx.eval(one[fused])
        gap = mx.max(mx.abs(one[True] - one[False])).item()
        shift = mx.max(mx.abs(one[False] - logits["base"][:3])).item()
        print(f"one stack {spec}: max |kernel - ops| {gap:.5f}, ops - base {shift:.4f}")
        assert shift > 20 * gap, "one stack's kernel update must match the ops"

if __name__ == "__main__":
    main()
