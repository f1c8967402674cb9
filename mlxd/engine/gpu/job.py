"""A generation request as the GPU thread sees it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mlxd.engine.gpu.ticket import Ticket


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class PrefillGroup:
    """The choices of one request (n > 1): the same prompt, prefilled once for all of them.

    The batch lane runs the prompt, all but its last token, once into `kv`; each choice then
    starts as a row from a view of it. GPU thread only, after the loop thread made it.
    """

    size: int
    target: int  # tokens prefilled once: the prompt but its last (each row runs that one for its first logits)
    kv: list[Any] | None = None  # the prompt's KV so far (None: not started)
    done: int = 0  # prompt tokens in `kv`
    cached: int = 0  # of those, served from the prompt cache
    inserted: int = 0  # choices started from it
    waiting: list[Any] = field(default_factory=list)  # choices' Sequences in the lane, waiting for the prefill

    @property
    def is_prefilled(self) -> bool:
        return self.kv is not None and self.done >= self.target


@dataclass(slots=True)
class Job:
    """Everything the GPU thread needs: prompt ids, limits, and where to send events."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: list[str]
    ticket: Ticket
    submitted_at: float = field(default_factory=time.perf_counter)
    grammar: Any = None  # an llguidance matcher the reply is held to (mlxd.engine.chat.grammar)
    logprobs: int | None = None  # None: none; else the chosen token's and this many alternatives (0-20)
    group: PrefillGroup | None = None  # a choice of an n > 1 request: its prompt is prefilled once
    priority: int = 0  # lower starts sooner; equal ones in the order they came (the scheduler's queue)
