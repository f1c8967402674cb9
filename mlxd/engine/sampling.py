"""Turn request sampling parameters into mlx-lm's sampler and logits processors."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

# How many recent tokens (prompt and completion) the penalties look at; mlx-lm's default is 20.
PENALTY_CONTEXT = 256
# mlx-lm scales logits by 1/temperature: past 65504 (float16's largest) they turn to inf and NaN
# and the "sample" is noise, while a temperature this small already means the likeliest token.
MIN_TEMPERATURE = 1e-4
Processor = Callable[[mx.array, mx.array], mx.array]


def make_sampling(params: Any, cached_prefix: list[int]) -> tuple[Callable[[mx.array], mx.array], list[Any]]:
    """The sampler and logits processors for one request (GPU thread).

    mlx-lm's processors see only the tokens handed to generate_step, so the part of the prompt
    served from the prompt cache is prepended: warm and cold caches then penalize alike.
    """
    sampler = make_sampler(**sampler_args(params))
    processors = make_logits_processors(
        logit_bias=params.logit_bias or None,
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=PENALTY_CONTEXT,
        presence_penalty=params.presence_penalty,
        presence_context_size=PENALTY_CONTEXT,
        frequency_penalty=params.frequency_penalty,
        frequency_context_size=PENALTY_CONTEXT,
    )
    if cached_prefix and processors:
        history = mx.array(cached_prefix[-PENALTY_CONTEXT:])
        processors = [with_history(p, history) for p in processors]
    return sampler, processors


def sampler_args(params: Any) -> dict[str, Any]:
    """mlx-lm's make_sampler arguments meaning what OpenAI's do at the edges of their ranges."""
    temp = params.temperature if params.temperature >= MIN_TEMPERATURE else 0.0
    # mlx-lm reads top_p=0 as "off" (and cannot apply it); for OpenAI it keeps the top token only.
    if params.top_p == 0.0:
        return {"temp": temp, "top_k": 1}
    return {"temp": temp, "top_p": params.top_p, "min_p": params.min_p, "top_k": params.top_k}


def with_history(processor: Processor, history: mx.array) -> Processor:
    """A processor that also sees `history` before the tokens generate_step tracks."""

    def run(tokens: mx.array, logits: mx.array) -> mx.array:
        return processor(mx.concatenate([history, tokens]), logits)

    return run


def seed_rng(seed: int | None) -> None:
    """Seed MLX's global RNG: the request's seed, else fresh entropy (serial lane only)."""
    # OpenAI's seed is any int64; MLX takes a uint64.
    mx.random.seed(seed % 2**64 if seed is not None else int.from_bytes(os.urandom(8), "little"))
