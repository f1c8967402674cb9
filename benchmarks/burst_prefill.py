"""A burst's prefill in one process: mlxd's batch lane against mlx-lm's BatchGenerator.

Eight (`--rows`) random prompts of `--prompt-tokens` start at once; the time from their
admission to every row's first token, for mlx-lm's `BatchGenerator` (prefill batch of 8,
chunks of `--prefill-step`, as the lane runs it) and for mlxd's BatchLane at `--width` and
at a width of `--rows`, alternated over `--rounds`. No HTTP, no engine process: it tells
whether a gap seen through `batching.py` is the lane's or its surroundings'.

`--preamble N`: the prompts share their first N tokens (a chat template's preamble), and a
variant `lane, preamble cached` runs the lane with those N in its prompt cache (each row then
starts from them: batch_lane.py's uniform starts) beside the lane with no cache.

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python benchmarks/burst_prefill.py --model ~/.local/share/mlxd/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.gpu.batch_lane import BatchLane
from mlxd.engine.gpu.job import Job, SamplingParams
from mlxd.engine.gpu.sequence import Sequence
from mlxd.engine.gpu.stats import Stats
from mlxd.engine.gpu.ticket import Ticket
from mlxd.engine.models.loaded_model import LoadedModel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=204)
    p.add_argument("--prefill-step", type=int, default=512)
    p.add_argument("--width", type=int, default=32, help="the lane's batch width (batch auto's on this CPU: 32)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--preamble", type=int, default=0, help="tokens every prompt starts with (0: none)")
    args = p.parse_args()
    loaded = LoadedModel(args.model.expanduser(), "bench")
    loop = asyncio.new_event_loop()
    rng = random.Random(0)

    preamble = [rng.randrange(100, loaded.vocab_size - 100) for _ in range(args.preamble)]

    def prompts() -> list[list[int]]:
        return [preamble + [rng.randrange(100, loaded.vocab_size - 100) for _ in range(args.prompt_tokens - len(preamble))]
                for _ in range(args.rows)]

    def preamble_cache() -> PrefixCache:
        """A prompt cache holding the preamble (and one token after it no prompt has next)."""
        cache = PrefixCache(1 << 30)
        kv = make_prompt_cache(loaded.model)
        tokens = [*preamble, 7]
        loaded.model(mx.array([tokens]), cache=kv)
        mx.eval([c.state for c in kv])
        cache.store(kv, tokens)
        return cache

    def raw() -> float:
        gen = BatchGenerator(loaded.model, max_tokens=2, prefill_batch_size=8, prefill_step_size=args.prefill_step,
                             completion_batch_size=args.width)
        t0 = time.perf_counter()
        gen.insert(prompts())
        seen: set[int] = set()
        while len(seen) < args.rows:
            seen.update(r.uid for r in gen.next_generated())
        took = time.perf_counter() - t0
        while gen.next_generated():  # to the end: nothing left behind for the next variant
            pass
        return took

    def lane(width: int, cache: PrefixCache | None = None) -> float:
        lane = BatchLane(loaded, Stats(), prefill_step=args.prefill_step, width=width,
                         prompt_cache=cache if cache is not None else PrefixCache(0))
        seqs = [Sequence(Job(p, 2, SamplingParams(temperature=0.0), [], Ticket(loop)), loaded.tokenizer, set())
                for p in prompts()]
        t0 = time.perf_counter()
        for seq in seqs:
            lane.admit(seq)
        while not all(seq.generated for seq in seqs):
            lane.step()
        took = time.perf_counter() - t0
        while lane.has_work:
            lane.step()
        return took

    print(f"{args.rows} prompts of {args.prompt_tokens} tokens, chunks of {args.prefill_step}; "
          "seconds to every row's first token")
    for i in range(-1, args.rounds):  # round -1 warms up
        row = {"raw": raw(), f"lane (width {args.width})": lane(args.width),
               f"lane (width {args.rows})": lane(args.rows)}
        if preamble:
            row["lane, preamble cached"] = lane(args.width, preamble_cache())
        print(f"round {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
