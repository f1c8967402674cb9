"""Turn request sampling parameters into mlx-lm's sampler and logits processors."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)

from mlxd.engine.chat.grammar import GrammarMask
from mlxd.engine.gpu.batch_bias import LogitBias
from mlxd.engine.gpu.curve import CurveProcessor, HlgProcessor

# How many recent tokens (prompt and completion) the penalties look at by default (a request's
# `*_context_size` sets its own); mlx-lm's default is 20.
PENALTY_CONTEXT = 256
XTC_THRESHOLD = 0.1  # mlx-lm's and the reference's default
# mlx-lm scales logits by 1/temperature: past 65504 (float16's largest) they turn to inf and NaN
# and the "sample" is noise, while a temperature this small already means the likeliest token.
MIN_TEMPERATURE = 1e-4
Processor = Callable[[mx.array, mx.array], mx.array]
Sampler = Callable[[mx.array], mx.array]


def make_sampling(params: Any, history: list[int], grammar: Any = None,
                  eos_ids: list[int] | None = None, position: int = 0) -> tuple[Sampler, list[Any]]:
    """The sampler and logits processors for one request (GPU thread).

    mlx-lm's processors see only the tokens their generator tracks: `history` is what comes
    before those (the serial lane's cached prompt prefix; the batch lane tracks it all).
    Requests with equal parameters and no seed share one sampler object, so that the batch
    lane samples all their rows in one call. A seeded request gets a sampler with its own
    random key: its tokens depend on its seed only, not on what else the engine runs. That key
    is drawn afresh for each token from the seed and the token's place in the reply (`position`:
    the first token's, past a continued reply's output), so a reply continued after a crash
    draws what the uninterrupted one would have.
    A `grammar` (an llguidance matcher) adds its mask after bias and penalties, and a curve
    (gpu/curve.py) shapes what is left last (the request's temperature is then 1.0).
    """
    args = sampler_args(params)
    xtc = xtc_args(params)
    sampler = (make_seeded_sampler(args, params.seed, xtc, position) if params.seed is not None
               else shared_sampler(**args, **xtc))
    # mlx-lm's order: the bias first, then the penalties. LogitBias is batch_bias.py's, so the
    # batch lane can add every row's bias in one op.
    processors: list[Any] = [LogitBias(params.logit_bias)] if params.logit_bias else []
    processors += make_logits_processors(
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=params.repetition_context_size,
        presence_penalty=params.presence_penalty,
        presence_context_size=params.presence_context_size,
        frequency_penalty=params.frequency_penalty,
        frequency_context_size=params.frequency_context_size,
    )
    if history and processors:
        back = max(params.repetition_context_size, params.presence_context_size, params.frequency_context_size)
        prefix = mx.array(history[-back:])
        processors = [with_history(p, prefix) for p in processors]
    if grammar is not None:
        processors.append(GrammarMask(grammar, eos_ids or []))
    if params.curve is not None:
        processors.append(CurveProcessor(params.curve))
    elif params.hlg is not None:
        processors.append(HlgProcessor(params.hlg))
    return sampler, processors


def sampler_args(params: Any) -> dict[str, Any]:
    """mlx-lm's make_sampler arguments meaning what OpenAI's do at the edges of their ranges."""
    temp = params.temperature if params.temperature >= MIN_TEMPERATURE else 0.0
    # mlx-lm reads top_p=0 as "off" (and cannot apply it); for OpenAI it keeps the top token only.
    if params.top_p == 0.0:
        return {"temp": temp, "top_p": 1.0, "min_p": 0.0, "top_k": 1}
    return {"temp": temp, "top_p": params.top_p, "min_p": params.min_p, "top_k": params.top_k}


def xtc_args(params: Any) -> dict[str, Any]:
    """mlx-lm's XTC arguments for make_sampler (none when the request asks for no XTC)."""
    if not params.xtc_probability:
        return {}
    return {"xtc_probability": params.xtc_probability, "xtc_threshold": params.xtc_threshold,
            "xtc_special_tokens": params.xtc_exempt}


@functools.lru_cache(maxsize=256)
def shared_sampler(temp: float, top_p: float, min_p: float, top_k: int, xtc_probability: float = 0.0,
                   xtc_threshold: float = XTC_THRESHOLD, xtc_special_tokens: tuple[int, ...] = ()) -> Sampler:
    """mlx-lm's sampler for these parameters, one object per distinct set (greedy: always one)."""
    return make_sampler(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k, xtc_probability=xtc_probability,
                        xtc_threshold=xtc_threshold, xtc_special_tokens=list(xtc_special_tokens))


def make_seeded_sampler(args: dict[str, Any], seed: int, xtc: dict[str, Any] | None = None,
                        position: int = 0) -> Sampler:
    """mlx-lm's sampling chain, drawing from random keys of its own (OpenAI's seed is any int64),
    XTC's coin too: the key of the token at `position` (counted from the reply's first) and of
    each after it is `token_key(seed, position)`, whatever came before."""
    temp = args["temp"]
    if temp == 0:
        return shared_sampler(**args)  # greedy: the seed changes nothing
    truncate = sampling_filters(args["top_p"], args["min_p"], 0)
    top_k = sampling_filters(1.0, 0.0, args["top_k"])  # after XTC, in mlx-lm's chain
    base = seed % 2**64

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal position
        key = token_key(base, position)
        position += 1
        if xtc:
            draw, coin = mx.random.split(key)
        else:
            draw = key
        for method in truncate:
            logprobs = method(logprobs)
        if xtc:
            logprobs = exclude_top_choices(logprobs, coin, **xtc)
        for method in top_k:
            logprobs = method(logprobs)
        return mx.random.categorical(logprobs * (1.0 / temp), key=draw)

    return sample


MASK64 = 2**64 - 1


def token_key(seed: int, position: int) -> mx.array:
    """The random key of a seeded reply's token at `position`: the seed and the place mixed
    (splitmix64's finalizer), so neighbouring places and seeds draw unrelated keys."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return mx.random.key(z ^ (z >> 31))


def exclude_top_choices(logprobs: mx.array, coin: mx.array, xtc_probability: float, xtc_threshold: float,
                        xtc_special_tokens: tuple[int, ...]) -> mx.array:
    """XTC with a coin of the caller's key: with `xtc_probability`, every token above the
    threshold but the least likely of them is excluded (`xtc_special_tokens` never are)."""
    probs = mx.softmax(logprobs, -1)
    mask = probs > mx.where(probs > xtc_threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    if xtc_special_tokens:
        mask[..., list(xtc_special_tokens)] = False
    return mx.where(mx.random.uniform(key=coin) > xtc_probability, logprobs, mx.where(mask, -mx.inf, logprobs))


def sampling_filters(top_p: float, min_p: float, top_k: int) -> list[Callable[[mx.array], mx.array]]:
    """The truncations mlx-lm's make_sampler applies, in its order."""
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0 < top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, top_p))
    if min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, min_p, 1))
    if top_k > 0:
        filters.append(lambda x: apply_top_k(x, top_k))
    return filters


def with_history(processor: Processor, history: mx.array) -> Processor:
    """A processor that also sees `history` before the tokens its generator tracks."""

    def run(tokens: mx.array, logits: mx.array) -> mx.array:
        return processor(mx.concatenate([history, tokens]), logits)

    return run
