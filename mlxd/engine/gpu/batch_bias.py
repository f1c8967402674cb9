"""Logit biases and grammar masks for all rows of a batched step in one op each.

mlx-lm's BatchGenerator runs logits processors row by row: for each row with any, it slices
that row's logits, updates its token history and calls each processor, then concatenates the
rows again. With a `logit_bias` on every row (clients use it to ban tokens; benchmarks to keep
EOS away) that is several small ops per row and step: 0.4 ms of a 4.6 ms step at 8 rows and
1.1 ms of 7.1 ms at 16 rows on the H200 (docs/benchmarks.md). A grammar mask costs more: its
bitmask is uploaded and expanded per row, and 4 held rows of 8 took a third of the H200's
batched decode. So when every processor of every row is a `LogitBias` or a `GrammarMask`,
the lane's generation batch adds one (rows, vocab) bias matrix to the step's logits, and
masks every held row at once: one read of the step's input tokens (the tokens sampled last,
which each matcher is fed), the rows' bitmasks stacked on the host, one upload and one fused
kernel. mlx-lm's step then runs as if no row had a processor. Anything else (penalties) takes
mlx-lm's own path unchanged.

A mask reads no history of mlx-lm's: it is fed the row's input token, and the per-row path
feeds it only what its history gained since it last ran, so the two paths can alternate.
Only the lane's own generation batch changes class (as flat_rows.py does for layers); the
first token of a newly prefilled row is still sampled by mlx-lm's path, with the same bias
and mask.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, GenerationBatch

from mlxd.engine.chat.grammar import ALL_ALLOWED, DeviceWords, GrammarMask, apply_words, read_early

log = logging.getLogger("mlxd.engine")


class LogitBias:
    """A logits processor adding fixed values to some tokens' logits (mlx-lm's interface)."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.tokens = list(bias)
        self.values = list(bias.values())
        self._indices = mx.array(self.tokens)
        self._values = mx.array(self.values)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        return logits.at[:, self._indices].add(self._values)


class BiasedStepBatch(GenerationBatch):
    """GenerationBatch whose step adds the rows' logit biases as one matrix and applies their
    grammar masks in one op, when it can."""

    _bias_rows: list[list[Any]] | None = None  # the rows' processor lists the matrix was built for
    _bias: mx.array | None = None
    _device_words: DeviceWords | None = None

    @property
    def _words(self) -> DeviceWords:
        if self._device_words is None:
            self._device_words = DeviceWords()
        return self._device_words

    def _step(self) -> Any:
        processors = self.logits_processors
        if not processors or not any(processors) or not all(isinstance(p, LogitBias | GrammarMask)
                                                            for row in processors for p in row):
            return super()._step()
        masks = [next((p for p in row if isinstance(p, GrammarMask)), None) for row in processors]
        if any(m is not None and not m.started for m in masks):
            return super()._step()
        has_bias = any(isinstance(p, LogitBias) for row in processors for p in row)
        held = any(m is not None for m in masks)
        model = self.model

        def processed(inputs: mx.array, cache: Any = None) -> mx.array:
            logits = model(inputs, cache=cache)
            if has_bias:
                logits = logits + self._bias_matrix(processors, logits.shape[-1], logits.dtype)[:, None, :]
            if held:
                rows, _, vocab = logits.shape
                sampled = read_early(inputs.reshape(-1), logits)
                words = np.full((rows, -(-vocab // 32)), ALL_ALLOWED, dtype=np.uint32)
                for r, m in enumerate(masks):
                    if m is not None:
                        words[r] = m.words([sampled[r]], vocab)
                logits = apply_words(logits.reshape(rows, vocab), self._words.get(words)).reshape(rows, 1, vocab)
            return logits

        self.model, self.logits_processors = processed, [[] for _ in processors]  # type: ignore[assignment]
        try:
            return super()._step()
        finally:
            self.model, self.logits_processors = model, processors

    def _bias_matrix(self, processors: list[list[Any]], vocab: int, dtype: Any) -> mx.array:
        """(rows, vocab) in the logits' dtype (so sums round as mlx-lm's per-row add does): each
        row's biases summed; rebuilt only when the rows change."""
        built = self._bias_rows
        if (built is not None and self._bias is not None and self._bias.shape[1] == vocab and self._bias.dtype == dtype
                and len(built) == len(processors) and all(a is b for a, b in zip(built, processors, strict=True))):
            return self._bias
        rows, cols, values = [], [], []
        for r, row in enumerate(processors):
            for p in row:
                if isinstance(p, LogitBias):
                    rows += [r] * len(p.tokens)
                    cols += p.tokens
                    values += p.values
        bias = mx.zeros((len(processors), vocab), dtype=mx.float32)
        if rows:
            bias = bias.at[mx.array(rows), mx.array(cols)].add(mx.array(values, dtype=mx.float32))
        self._bias_rows, self._bias = list(processors), bias.astype(dtype)
        return self._bias


def batch_bias(gen: BatchGenerator) -> bool:
    """Give `gen`'s generation batch the one-op bias step; False where mlx-lm's differs."""
    batch = getattr(gen, "_generation_batch", None)
    if type(batch) is not GenerationBatch or not all(hasattr(batch, a) for a in ("model", "logits_processors")):
        log.warning("mlx-lm's BatchGenerator has changed shape: logit biases run row by row")
        return False
    batch.__class__ = BiasedStepBatch
    return True
