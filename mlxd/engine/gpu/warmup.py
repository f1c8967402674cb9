"""`--warmup`: run the shapes the first users will, before the engine reports ready.

MLX's CUDA backend compiles a kernel the first time each shape is used, and a batched decode
step has a new shape for every number of rows: on an H200 a first-seen width stalled every
row for seconds. This runs a lone sequence (the serial lane's path), then one batch of
`width` rows whose replies end one step apart, so that the decode step runs at every width
from `width` down to 1 (a 64-token prompt: prefill shapes of real prompts still compile on
first use). `auto` warms up where
kernels are compiled at run time and it pays (CUDA); Metal and CPU start at once.
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step

from mlxd.engine.models.loaded_model import LoadedModel

PROMPT_TOKENS = 64
NEW_TOKENS = 4


def wanted(mode: str) -> bool:
    """Whether `--warmup MODE` (on, off, auto) warms up on this machine."""
    if mode == "auto":
        return bool(mx.cuda.is_available())
    return mode == "on"


def warm_up(loaded: LoadedModel, width: int, prefill_step: int) -> float:
    """Run the common shapes once; the seconds it took (GPU thread)."""
    started = time.perf_counter()
    prompt = [i % max(1, loaded.vocab_size - 1) + 1 for i in range(PROMPT_TOKENS)]
    for _ in generate_step(mx.array(prompt), loaded.model, max_tokens=NEW_TOKENS, prefill_step_size=prefill_step):
        pass
    if width > 1:
        gen = BatchGenerator(loaded.model, completion_batch_size=width, prefill_batch_size=min(width, 8),
                             prefill_step_size=prefill_step)
        gen.insert([prompt] * width, max_tokens=[NEW_TOKENS + i for i in range(width)])
        while gen.next_generated():
            pass
        gen.close()
    mx.synchronize()
    return time.perf_counter() - started
