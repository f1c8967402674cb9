"""What a row leaving costs a decoding batch: mlx-lm's BatchGenerator, one row removed at a time.

A row that ends leaves mlx-lm's batch at once: every layer's KV is gathered into arrays one row
smaller (`BatchKVCache.filter`, which also reads the rows' padding on the host). On an H100 the
traced turns in which an 8-row batch shrank took 62-98 ms where a plain step took 20.4
(docs/benchmarks.md, issue 27). This probe takes the batch lane's decode path (mlx-lm's
BatchGenerator with mlxd's fused decode attention and flattened rows where they win), decodes
`--rows` rows, then removes them one at a time, `--gap` steps apart, and times:

  * the removal itself (`remove`: the filter, on the host),
  * the first three steps after it, each alone (`next` until its tokens are read),
  * the plain steps at each width (the median of the gap's later steps),

so a shrink's cost is set against what a row costs a step (what keeping an ended row in the
batch, masked, would cost instead). `--rounds` repeats the whole descent (shapes seen before).

  python benchmarks/shrink_step.py /tmp/models/l8q --rows 8 --prompt 300
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--gap", type=int, default=12, help="steps between removals")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from mlxd.engine.gpu import decode_attention
    from mlxd.engine.gpu.flat_rows import flatten_quantized_rows, wins_here

    model, _ = load(a.model)
    flattened = flatten_quantized_rows(model) if wins_here() else 0
    fused = decode_attention.enabled() and decode_attention.install(model)
    vocab = model.args.vocab_size
    print(f"{a.model}: {a.rows} rows of {a.prompt} prompt tokens, {flattened} flattened layers, "
          f"fused decode attention {'on' if fused else 'off'}, device {mx.default_device()}", flush=True)

    def step_ms(gen: BatchGenerator) -> float:
        t = time.perf_counter()
        gen.next_generated()
        return (time.perf_counter() - t) * 1000

    for rnd in range(a.rounds):
        gen = BatchGenerator(model, completion_batch_size=a.rows, prefill_batch_size=min(a.rows, 8))
        prompts = [[(i * 31 + r * 7 + rnd) % (vocab - 5) + 2 for i in range(a.prompt + r)] for r in range(a.rows)]
        uids = gen.insert(prompts, max_tokens=[100_000] * a.rows)
        t0 = time.perf_counter()
        while not gen.next_generated():
            pass
        warm = [step_ms(gen) for _ in range(a.gap)]
        print(f"round {rnd}: prefilled in {time.perf_counter() - t0:.1f} s; the first steps (ms): "
              f"{', '.join(f'{x:.1f}' for x in warm)}", flush=True)  # a first run's compiles show here
        lines = []
        for width in range(a.rows, 1, -1):
            plain = [step_ms(gen) for _ in range(a.gap)]
            t = time.perf_counter()
            gen.remove([uids[width - 1]])
            removal = (time.perf_counter() - t) * 1000
            after = [step_ms(gen) for _ in range(3)]
            lines.append((width, statistics.median(plain[a.gap // 2:]), removal, after))
        gen.close()
        print(f"round {rnd}: width, plain step ms (median), remove ms, the 3 steps after (ms), "
              "extra over the narrower width's plain step", flush=True)
        for i, (width, plain_ms, removal, after) in enumerate(lines):
            narrower = lines[i + 1][1] if i + 1 < len(lines) else after[-1]
            extra = removal + sum(after) - 3 * narrower
            print(f"  {width}->{width - 1}: plain {plain_ms:.2f}, remove {removal:.2f}, after "
                  f"{', '.join(f'{x:.2f}' for x in after)}, extra {extra:.1f}", flush=True)


if __name__ == "__main__":
    main()
