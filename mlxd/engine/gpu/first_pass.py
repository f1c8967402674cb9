"""A prompt's last piece and its first token in one pass over the weights.

mlx-lm's generate_step prefills a prompt but for its last token, then runs that token alone for
the first logits: two passes over the model's weights where one does. A pass's cost hardly grows
with its length while it is short (an 8B 4-bit model on an H100: a pass of 47 tokens over 5,024
cached ones 42.5 ms, of 48 tokens 37.9 ms, of one 10.5 ms; SmolLM2 on the 2-core CPU: a decode
step 75-95 ms, a pass of 8 tokens 124 ms: docs/benchmarks.md, issue 29). So the serial lane runs
the last piece of a prompt (a resumed reply's tokens after its checkpoint, a new prompt's last
chunk) and its first token as one pass, then decodes one token ahead as generate_step does
(`steps`).

A model makes logits for every position it is given, and the first token wants the last one's:
M rows of the vocabulary's projection, work and memory (on the CPU about 0.7 ms a row for
SmolLM2) that a long piece does not want. `install(model)` gives the model's output projection
(its `lm_head`, or the embedding a tied model projects with) a class that projects only the last
position while a first pass runs, and checks on a short pass that the logits are the whole
pass's. Where that is not done (the projection not found, the check failed, a model the lane was
handed without it), the lane joins only pieces of up to SHORT_PIECE tokens, where the extra rows
cost less than the step they save. `MLXD_JOIN_FIRST_PASS=0` turns the joining off (the last
token alone, as generate_step runs it), to measure against.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream, maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

log = logging.getLogger("mlxd.engine")

ENV = "MLXD_JOIN_FIRST_PASS"
SHORT_PIECE = 16  # the longest piece joined with its first token when every row's logits are made
MARK = "_mlxd_last_row"  # set on a model whose output projection install() changed and checked
TOLERANCE = 1e-2  # of the logits' largest magnitude: the last row alone against the whole pass

_last_only = False  # while a first pass is built: the projection takes the last position only
_classes: dict[tuple[type, str], type] = {}


def installed(model: Any) -> bool:
    return bool(getattr(model, MARK, False))


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def longest_piece(model: Any, chunk: int) -> int:
    """The longest last piece the lane joins with its first token for this model (1: none)."""
    if not enabled():
        return 1
    return chunk if installed(model) else min(chunk, SHORT_PIECE)


@contextlib.contextmanager
def last_row_only() -> Iterator[None]:
    global _last_only
    _last_only = True
    try:
        yield
    finally:
        _last_only = False


def install(model: Any) -> bool:
    """Give the model's output projection the last-row class and check it; whether it is on."""
    heads = list(_projections(model)) if enabled() else []
    if not heads:
        return False
    was = [(module, type(module)) for module, _ in heads]
    for module, method in heads:
        module.__class__ = _last_row_class(type(module), method)
    try:
        ok = _check(model)
    except Exception as exc:  # a model this does not fit: every row's logits, as mlx-lm makes them
        log.warning("last-row logits unavailable (%s: %s): a prompt's last piece joins its first token "
                    "only up to %d tokens", type(exc).__name__, exc, SHORT_PIECE)
        ok = False
    if not ok:
        for module, cls in was:
            module.__class__ = cls
        return False
    object.__setattr__(model, MARK, True)
    return True


def _projections(model: Any) -> Iterator[tuple[Any, str]]:
    """The modules that may make the logits: an `lm_head` layer, and the token embedding (a tied
    model projects with its `as_linear`)."""
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "lm_head" and isinstance(module, (nn.Linear, nn.QuantizedLinear)):
            yield module, "__call__"
        elif leaf == "embed_tokens" and isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)):
            yield module, "as_linear"


def _last_row_class(cls: type, method: str) -> type:
    if (made := _classes.get((cls, method))) is not None:
        return made
    inner: Callable[..., mx.array] = getattr(cls, method)

    def project(self: Any, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if _last_only and x.ndim == 3 and x.shape[1] > 1:
            x = x[:, -1:, :]
        return inner(self, x, *args, **kwargs)

    made = _classes[(cls, method)] = type(cls.__name__, (cls,), {method: project, "__module__": cls.__module__})
    return made


def _check(model: Any) -> bool:
    """Whether a short pass's last logits with the projection of the last row alone are the whole
    pass's (the same shape, within TOLERANCE of their largest magnitude)."""
    tokens = mx.array([[1, 2, 3]])
    whole = model(tokens, cache=make_prompt_cache(model))[:, -1, :]
    with last_row_only():
        last = model(tokens, cache=make_prompt_cache(model))
    if last.shape[1] != 1 or last[:, -1, :].shape != whole.shape:
        log.warning("last-row logits have shape %s against %s: not used", last.shape, whole.shape)
        return False
    whole, last = whole.astype(mx.float32), last[:, -1, :].astype(mx.float32)
    err, top = (float(mx.max(mx.abs(a)).item()) for a in (whole - last, whole))  # type: ignore[arg-type]
    if err > TOLERANCE * max(top, 1.0):
        log.warning("last-row logits differ from the whole pass's (max %.4g of %.4g): not used", err, top)
        return False
    return True


def steps(model: Any, piece: mx.array, cache: list[Any], sampler: Callable[[mx.array], mx.array],
          processors: list[Any], max_tokens: int, kv_bits: int | None = None, kv_group_size: int = 64,
          quantized_kv_start: int = 0) -> Iterator[tuple[Any, mx.array]]:
    """generate_step's tokens from a cache holding the prompt but for `piece`, which the first
    pass takes whole: (token, logprobs) pairs, the GPU a token ahead, as generate_step runs."""
    history: mx.array | None = None  # what the processors see: the piece, then each token

    def step(tokens: mx.array, first: bool = False) -> tuple[mx.array, mx.array]:
        nonlocal history
        with mx.stream(generation_stream):
            with last_row_only() if first else contextlib.nullcontext():
                logits = model(tokens[None], cache=cache)
            logits = logits[:, -1, :]
            if processors:
                history = tokens if history is None else mx.concat([history, tokens])
                for processor in processors:
                    logits = processor(history, logits)
            maybe_quantize_kv_cache(cache, quantized_kv_start, kv_group_size, kv_bits)
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return sampler(logprobs), logprobs.squeeze(0)

    y, logprobs = step(piece, first=True)
    mx.async_eval(y, logprobs)
    n = 0
    while True:
        if n != max_tokens:
            next_y, next_logprobs = step(y)
            mx.async_eval(next_y, next_logprobs)
        if n == 0:
            mx.eval(y)
        if n == max_tokens:
            break
        yield y.item(), logprobs
        if n % 256 == 0:
            mx.clear_cache()
        y, logprobs = next_y, next_logprobs
        n += 1
