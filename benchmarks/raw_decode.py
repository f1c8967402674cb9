"""A lone stream's decode speed in raw mlx-lm under this process's MLX settings.

What MLX's settings (`MLX_USE_CUDA_GRAPHS` above all) cost mlx-lm's own `stream_generate`, one
process per setting, alternated by the caller: a fresh random prompt of `--prompt` tokens, then
`--max-tokens` greedy tokens with EOS biased away, after one warm-up run; prints each run's
decode tokens/s (after the first token) and their median.

  for g in 1 0 1 0; do MLX_USE_CUDA_GRAPHS=$g python benchmarks/raw_decode.py /tmp/models/l1b32; done
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from mlx_lm import load
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_logits_processors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    model, tok = load(args.model)
    processors = make_logits_processors(logit_bias={t: -100.0 for t in tok.eos_token_ids})
    vocab = model.args.vocab_size
    rng = random.Random(0)
    rates = []
    for i in range(-1, args.runs):
        ids = [rng.randrange(100, vocab - 100) for _ in range(args.prompt)]
        stamps = [time.perf_counter() for _ in stream_generate(model, tok, ids, max_tokens=args.max_tokens,
                                                               logits_processors=processors)]
        if i >= 0:
            rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    settings = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    print(f"{settings or 'MLX defaults'}: decode tok/s {[round(r, 1) for r in rates]}, "
          f"median {statistics.median(rates):.1f}", flush=True)


if __name__ == "__main__":
    main()
