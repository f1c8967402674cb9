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
