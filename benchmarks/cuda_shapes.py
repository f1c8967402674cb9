"""What a first-seen shape costs on MLX's CUDA backend, under different MLX settings.

MLX's CUDA backend builds a cuDNN attention graph for each new attention shape (prompt
length, cache length, rows) and caches it; an LLM server sees a new prompt length with
nearly every request. This probe runs, in one process per setting (MLX reads its settings
once), on one model:

  * prefill: lone prompts of 16 new lengths (200-215 tokens), then the same lengths again
    (seen): the first-seen cost is the difference;
  * burst: BatchGenerator, 8 prompts of new lengths inserted at once, time until each has
    its first token; then 8 prompts of the same lengths again;
  * decode: BatchGenerator, 8 rows decoding 600 tokens (the KV crosses 256-token steps):
    step p50 and max, and the time spent in steps over 3x the median (stalls);
  * long: an 8000-token prompt prefilled in 512-token chunks and in one chunk, first and again;
  * lone: one stream's decode tokens/s (generate_step, 256 tokens, median of 3).

  python benchmarks/cuda_shapes.py /tmp/models/l1b
  python benchmarks/cuda_shapes.py /tmp/models/l1b --settings default,no-cudnn-sdpa
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "no-cudnn-sdpa": {"MLX_CUDA_USE_CUDNN_SDPA": "0"},
    "no-cudnn-ops100": {"MLX_CUDA_USE_CUDNN_SDPA": "0", "MLX_MAX_OPS_PER_BUFFER": "100"},
}


def ms(s: float) -> float:
    return round(s * 1000, 1)


def worker(model_dir: str, long_tokens: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator, generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(model_dir)
    vocab = model.args.vocab_size

    def tokens(n: int, salt: int) -> list[int]:
        return [(i * 7919 + salt * 104729) % (vocab - 10) + 5 for i in range(n)]

    def prefill(prompt: list[int], step: int) -> float:
        cache = make_prompt_cache(model)
        t = time.perf_counter()
        for _ in generate_step(mx.array(prompt), model, max_tokens=1, prompt_cache=cache, prefill_step_size=step):
            pass
        return time.perf_counter() - t

    prefill(tokens(64, 0), 512)  # the model's own first use
    out: dict[str, Any] = {}
    first = [prefill(tokens(n, n), 512) for n in range(200, 216)]
    again = [prefill(tokens(n, n + 1), 512) for n in range(200, 216)]
    out["prefill_first_ms"] = ms(statistics.median(first))
    out["prefill_seen_ms"] = ms(statistics.median(again))

    def burst(lengths: list[int], salt: int) -> list[float]:
        gen = BatchGenerator(model, completion_batch_size=16, prefill_batch_size=8, prefill_step_size=512)
        t = time.perf_counter()
        uids = gen.insert([tokens(n, salt + n) for n in lengths], max_tokens=[4] * len(lengths))
        firsts: dict[int, float] = {}
        while len(firsts) < len(uids):
            for r in gen.next_generated():
                firsts.setdefault(r.uid, time.perf_counter() - t)
        while gen.next_generated():
            pass
        gen.close()
        return sorted(firsts.values())

    lengths = list(range(300, 308))
    b1, b2 = burst(lengths, 1), burst(lengths, 2)
    out["burst8_first_ttft_ms"] = [ms(b1[0]), ms(b1[-1])]
    out["burst8_seen_ttft_ms"] = [ms(b2[0]), ms(b2[-1])]

    def decode(salt: int) -> dict[str, float]:
        gen = BatchGenerator(model, completion_batch_size=16, prefill_batch_size=8, prefill_step_size=512)
        gen.insert([tokens(200 + i, salt + i) for i in range(8)], max_tokens=[600] * 8)
        steps: list[float] = []
        while True:
            t = time.perf_counter()
            rs = gen.next_generated()
            if not rs:
                break
            steps.append(time.perf_counter() - t)
        gen.close()
        steps = steps[2:]
        med = statistics.median(steps)
        return {"p50_ms": ms(med), "max_ms": ms(max(steps)), "stall_ms": ms(sum(s for s in steps if s > 3 * med)),
                "tok_s": round(8 * len(steps) / sum(steps), 1)}

    out["decode8_first"] = decode(10)
    out["decode8_seen"] = decode(20)
    long_prompt = tokens(long_tokens, 3)
    out["long_512_first_ms"] = ms(prefill(long_prompt, 512))
    out["long_512_seen_ms"] = ms(prefill(tokens(long_tokens, 4), 512))
    out["long_8192_first_ms"] = ms(prefill(tokens(long_tokens, 5), 8192))
    out["long_8192_seen_ms"] = ms(prefill(tokens(long_tokens, 6), 8192))

    rates = []
    for k in range(3):
        n, t = 0, 0.0
        for i, _ in enumerate(generate_step(mx.array(tokens(200, 50 + k)), model, max_tokens=257)):
            if i == 0:
                t = time.perf_counter()
            else:
                n += 1
        rates.append(n / (time.perf_counter() - t))
    out["lone_tok_s"] = round(statistics.median(rates), 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--long-tokens", type=int, default=8000)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a.model, a.long_tokens)))
        return
    for name in a.settings.split(","):
        env = {**os.environ, **SETTINGS[name]}
        proc = subprocess.run([sys.executable, __file__, a.model, "--worker", "--long-tokens", str(a.long_tokens)], env=env, capture_output=True, text=True)
        if proc.returncode:
            print(f"{name}: failed\n{proc.stderr[-3000:]}", flush=True)
            continue
        print(f"{name} {json.dumps(SETTINGS[name])}: {proc.stdout.strip().splitlines()[-1]}", flush=True)


if __name__ == "__main__":
    main()
