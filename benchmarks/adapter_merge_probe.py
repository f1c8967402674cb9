"""A lone stream under an adapter, step by step (adapter_bank.py): one-row decode steps of the
base model, of an adapter unmerged (MLX ops, and lora_kernel.py where it runs), and of it
merged, and what making its merged copy costs.

  python benchmarks/adapter_merge_probe.py --model /tmp/models/l8b

Random adapters at mlx-lm's defaults (rank 8, every linear layer of the last 16 layers) are
mounted through mlxd's AdapterBank as the engine does. Every way is warmed up first, then
timed --repeats times in turn (this machine is noisy); the best of each is printed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlxd.engine.models import adapter_bank, lora_kernel
from mlxd.engine.models.adapter_bank import AdapterBank, merged_layer
from mlxd.engine.models.adapters import find_module
from mlxd.engine.models.random_adapter import build_random_adapter


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    model, _ = load(str(args.model))
    bank = AdapterBank(model)
    with tempfile.TemporaryDirectory() as tmp:
        stacks = []
        for i in range(5):
            path = build_random_adapter(args.model, Path(tmp) / f"a{i}", rank=8, scale=20.0, seed=i, num_layers=16,
                                        keys=None, strength=0.001)
            bank.mount(f"a{i}", path)
            stacks.append(bank.resolve(f"a{i}"))

    def merge_all(stack: adapter_bank.Stack) -> float:
        weights = bank._weights((stack,), mixed=False)
        mx.eval([w.a for w in weights.values()])
        t0 = time.perf_counter()
        made = {name: merged_layer(find_module(model, name), w) for name, w in weights.items()}
        mx.eval([m.parameters() for m in made.values()])
        return time.perf_counter() - t0

    merge_all(stacks[0])  # compiles
    merges = [merge_all(s) for s in stacks[1:4]]
    n = len(bank._weights((stacks[1],), mixed=False))

    cache = make_prompt_cache(model)
    tok = mx.array([[42]])
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=cache))
    lone = stacks[4]

    def steps() -> float:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            mx.eval(model(tok, cache=cache))
        return (time.perf_counter() - t0) / args.steps

    def under(merge: bool, fused: bool) -> Callable[[], float]:
        def run() -> float:
            bank.merge, bank.fused = merge, fused
            for _ in range(adapter_bank.MERGE_AFTER_PASSES if merge else 0):
                with bank.one(lone):
                    pass
            with bank.one(lone):
                assert bank.plan is not None and (bank.plan.merged is not None) == merge
                return steps()
        return run

    ways: dict[str, Callable[[], float]] = {"base": steps, "unmerged, MLX ops": under(False, False)}
    if lora_kernel.usable():
        ways["unmerged, kernel"] = under(False, True)
    ways["merged"] = under(True, True)
    for way in ways.values():
        way()  # warm-up
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(args.repeats):
        for name, way in ways.items():
            best[name] = min(best[name], way())
    print(f"merge of {n} layers: {', '.join(f'{m * 1e3:.1f}' for m in merges)} ms")
    for name, t in best.items():
        print(f"one-row decode step, {name}: {t * 1e3:.2f} ms ({best['base'] / t:.2f} of base)")
    print(f"the merge costs {min(merges) / best['base']:.1f} base steps")


if __name__ == "__main__":
    main()
