"""Turn request sampling parameters into mlx-lm's sampler and logits processors."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

# OpenAI's penalties look at the whole completion; mlx-lm's default window is 20 tokens.
PENALTY_CONTEXT = 256


def make_sampling(params: Any) -> tuple[Callable[[mx.array], mx.array], list[Any]]:
    """The sampler and logits processors for one request (GPU thread)."""
    sampler = make_sampler(
        temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k
    )
    processors = make_logits_processors(
        logit_bias=params.logit_bias or None,
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=PENALTY_CONTEXT,
        presence_penalty=params.presence_penalty,
        presence_context_size=PENALTY_CONTEXT,
        frequency_penalty=params.frequency_penalty,
        frequency_context_size=PENALTY_CONTEXT,
    )
    return sampler, processors


def seed_rng(seed: int | None) -> None:
    """Seed MLX's global RNG: the request's seed, else fresh entropy (serial lane only)."""
    mx.random.seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
