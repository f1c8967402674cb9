"""`--warmup`: run the shapes the first users will, before the engine reports ready.

MLX's CUDA backend compiles a kernel the first time each shape is used; the first burst of
requests would otherwise pay for it (tens of ms to seconds per shape). This runs a lone
sequence (the serial lane's path) and batches of 2, 4, 8 ... up to the batch width through
mlx-lm's BatchGenerator, a few tokens each, with a prompt long enough for a prefill chunk.
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step

from mlxd.engine.loaded_model import LoadedModel

PROMPT_TOKENS = 64
NEW_TOKENS = 4


def warm_up(loaded: LoadedModel, width: int, prefill_step: int) -> float:
    """Run the common shapes once; the seconds it took (GPU thread)."""
    started = time.perf_counter()
    prompt = [i % max(1, loaded.vocab_size - 1) + 1 for i in range(PROMPT_TOKENS)]
    for _ in generate_step(mx.array(prompt), loaded.model, max_tokens=NEW_TOKENS, prefill_step_size=prefill_step):
        pass
    rows = 2
    while rows <= width:
        gen = BatchGenerator(loaded.model, completion_batch_size=rows, prefill_batch_size=min(rows, 8),
                             prefill_step_size=prefill_step)
        gen.insert([prompt] * rows, max_tokens=[NEW_TOKENS] * rows)
        while gen.next_generated():
            pass
        gen.close()
        rows *= 2
    mx.synchronize()
    return time.perf_counter() - started
