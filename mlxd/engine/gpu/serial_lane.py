"""The serial lane: one sequence at a time with mlx-lm's generate_step, a token per step."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.gpu.job import Job
from mlxd.engine.gpu.sampling import make_sampling
from mlxd.engine.gpu.sequence import Sequence
from mlxd.engine.gpu.stats import Stats
from mlxd.engine.models.loaded_model import LoadedModel

log = logging.getLogger("mlxd.engine")


class Cancelled(Exception):
    """Raised inside prefill (from the progress callback) when the client went away."""


class SerialLane:
    """The fastest path for a lone request: generate_step keeps the GPU one token ahead (a Lane)."""

    def __init__(
        self, loaded: LoadedModel, stats: Stats, prefill_step: int, prompt_cache: PrefixCache,
        kv_bits: int | None = None, kv_group_size: int = 64,
    ) -> None:
        self._loaded = loaded
        self._stats = stats
        self._prefill_step = prefill_step
        self._prompt_cache = prompt_cache
        self._kv_bits = kv_bits  # quantize the KV from the first token (mlx-lm's QuantizedKVCache)
        self._kv_group_size = kv_group_size
        self._seq: Sequence | None = None
        self._steps: Iterator[tuple[Any, Any]] | None = None
        self._kv: list[Any] = []

    @property
    def has_work(self) -> bool:
        return self._seq is not None

    @property
    def num_rows(self) -> int:
        return int(self._seq is not None)

    @property
    def num_prefilling(self) -> int:
        return int(self._seq is not None and not self._seq.generated)

    def admit(self, seq: Sequence) -> None:
        """Start `seq` (the lane must be free); its prefill runs in the next step."""
        assert self._seq is None, "the serial lane runs one sequence at a time"
        job = seq.job
        kv, cached = self._prompt_cache.fetch(job.prompt)
        if kv is None:
            kv = list(make_prompt_cache(self._loaded.model))
        seq.start(cached)
        sampler, processors = make_sampling(job.sampling, job.prompt[:cached], job.grammar,
                                            sorted(self._loaded.eos_token_ids))
        self._steps = generate_step(
            mx.array(job.prompt[cached:]),
            self._loaded.model,
            max_tokens=job.max_tokens,
            sampler=sampler,
            logits_processors=processors,
            prompt_cache=kv,
            prefill_step_size=self._prefill_step,
            prompt_progress_callback=lambda *_: self._check_cancel(job),
            kv_bits=self._kv_bits,
            kv_group_size=self._kv_group_size,
            quantized_kv_start=0,
        )
        self._seq, self._kv = seq, kv

    def step(self) -> list[Sequence]:
        """One token for the running sequence (the whole prefill, for its first)."""
        seq, steps = self._seq, self._steps
        assert seq is not None and steps is not None
        try:
            if seq.is_cancelled:
                raise Cancelled
            token, logprobs = next(steps)
            if not seq.add(int(token), logprobs):
                return []
        except Cancelled:
            seq.cancel()
        except StopIteration:  # generate_step ran out (max_tokens), which `add` has seen
            seq.finish_reason = seq.finish_reason or "length"
        except Exception as exc:
            log.error("generation failed:\n%s", traceback.format_exc())
            self._close()
            seq.fail(self._stats, f"generation failed: {type(exc).__name__}: {exc}")
            return [seq]
        self._prompt_cache.store(self._kv, seq.history)
        self._close()
        seq.finish(self._stats)
        return [seq]

    def hand_over(self) -> tuple[Sequence, list[Any]] | None:
        """Give up the running sequence and its KV to the batch lane, if it can move.

        generate_step has fed the last token it yielded and is computing the next; that step
        is dropped (the KV trimmed to before the last token), and the batch lane feeds the last
        token again. A seeded sequence stays: its draws must not depend on when others came.
        """
        seq, kv = self._seq, self._kv
        if seq is None or not seq.generated or seq.job.sampling.seed is not None or seq.is_finished:
            return None
        offset = getattr(kv[0], "offset", None) if kv else None
        if offset != len(seq.job.prompt) + len(seq.generated):
            return None  # not the state we know how to move: keep it here
        self._close()
        trim_prompt_cache(kv, 1)
        return seq, kv

    def fail_all(self, message: str, code: str) -> list[Sequence]:
        """End the running sequence with an error (the lane's state is unknown)."""
        seq = self._seq
        self._close()
        if seq is None:
            return []
        seq.fail(self._stats, message, 500, code)
        return [seq]

    def _close(self) -> None:
        if self._steps is not None:
            close = getattr(self._steps, "close", None)
            if close is not None:
                close()
        self._seq, self._steps, self._kv = None, None, []

    def _check_cancel(self, job: Job) -> None:
        if job.ticket.is_cancelled:
            raise Cancelled
