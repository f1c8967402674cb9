"""What holes cost a batched decode step (issue 27): a plain batch against the same batch after
its rows refused drafts (spec/holes.py's HoleyKV), attention routed as the engine routes it.

A batch step that verifies drafts leaves each row's refused ones in the KV buffer as holes that
the step's mask hides, until they reach a quarter of the buffer and are gathered away. Every
plain step after it runs with that mask; before 2026-12-06 such a step fell back from mlxd's
decode attention (the fused kernel on CUDA, the split attention on the CPU) to MLX's unfused
attention. This builds both batches of `--rows` rows of about `--tokens` tokens, then times
`--steps` decode steps of each in turn, round after round (which goes first alternating), and
prints ms a step and holey / plain.

  python benchmarks/holey_step.py                      # SmolLM2-135M-Instruct, 8 rows of 500 tokens
  python3 benchmarks/holey_step.py --model /tmp/models/l8q --tokens 4000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_lm.models.cache import BatchKVCache

from mlxd.engine.gpu import cpu_attention, decode_attention
from mlxd.engine.spec.holes import HoleyKV, punch


def route(model: Any) -> list[str]:
    """The engine's routing (gpu/loader.py): the fused kernel on CUDA, split attention on the CPU."""
    if mx.cuda.is_available():
        return decode_attention.install(model)
    return cpu_attention.install(model)


def batch(model: Any, rows: int, tokens: int, holes: bool) -> tuple[list[Any], mx.array]:
    """Rows of `tokens` tokens (a little ragged: left padding), then a 5-token pass of which each
    row keeps its own share when `holes` (else a plain batch fed the same 5 tokens)."""
    vocab = model.args.vocab_size
    lengths = [tokens - (r * 37) % 64 for r in range(rows)]
    pads = [tokens - n for n in lengths]
    prompts = mx.array([[0] * p + [(i * 31 + r * 7) % (vocab - 5) + 2 for i in range(n)]
                        for r, (p, n) in enumerate(zip(pads, lengths, strict=True))])
    caches = [BatchKVCache(pads) for _ in model.layers]
    for start in range(0, tokens, 512):
        model(prompts[:, start:start + 512], cache=caches)
        mx.eval([c.state for c in caches])
    model(mx.full((rows, 5), 7, dtype=mx.int32), cache=caches)
    if holes:
        punch(caches, [(r % 4) + 1 for r in range(rows)])  # a row keeps 1-4 of the 4 drafts
        assert type(caches[0]) is HoleyKV
    mx.eval([c.state for c in caches])
    return caches, mx.full((rows, 1), 11, dtype=mx.int32)


def ms_a_step(model: Any, caches: list[Any], tok: mx.array, steps: int) -> float:
    """Median ms of `steps` greedy decode steps, each read before the next (as decode does)."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        logits = model(tok, cache=caches)[:, -1, :]
        tok = mx.argmax(logits, axis=-1)[:, None]
        mx.eval(tok)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="MLX model dir (default: SmolLM2-135M-Instruct from mlxd's models dir)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=500)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=8)
    a = p.parse_args()
    from mlx_lm import load

    if a.model is None:
        from batching import default_model

        a.model = str(default_model())
    model, _ = load(a.model)
    print(f"{a.model}: {a.rows} rows of about {a.tokens} tokens; attention routed in {route(model)}", flush=True)
    both = {holes: batch(model, a.rows, a.tokens, holes) for holes in (False, True)}
    rates: dict[bool, list[float]] = {False: [], True: []}
    for r in range(a.rounds + 1):  # round 0 warms both up, not counted; each round runs on from the last
        for holes in ((False, True) if r % 2 else (True, False)):
            caches, tok = both[holes]
            ms = ms_a_step(model, caches, tok, a.steps)
            if r:
                rates[holes].append(ms)
        if r:
            print(f"round {r}: plain {rates[False][-1]:.2f} ms, holey {rates[True][-1]:.2f} ms a step", flush=True)
    plain, holey = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"median ms a step: plain {plain:.2f}, holey {holey:.2f}; holey / plain {holey / plain:.3f}")


if __name__ == "__main__":
    main()
