"""A generation request as the GPU thread sees it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mlxd.engine.gpu.ticket import Ticket
from mlxd.engine.models.adapter_bank import Stack
from mlxd.engine.models.vision import MediaPrompt


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
    # How many recent tokens (prompt and completion) each penalty looks at (mlx-lm's default is 20)
    repetition_context_size: int = 256
    presence_context_size: int = 256
    frequency_context_size: int = 256
    xtc_probability: float = 0.0  # XTC: how often a step excludes its top choices (0: never)
    xtc_threshold: float = 0.1  # ... those above this probability, all but the least likely of them
    xtc_exempt: tuple[int, ...] = ()  # tokens XTC never excludes (EOS, newline)
    curve: tuple[tuple[float, float], ...] | None = None  # a drawn transfer curve in place of temperature
    hlg: tuple[float, float, float, float] | None = None  # ... or the HLG tone curve's knobs (protocol/curve.py)


@dataclass(slots=True, eq=False)
class PrefillGroup:
    """Rows that start from one prefill of the prompt prefix they share.

    Two kinds. The choices of one request (n > 1, made by the loop thread with the request):
    `size` choices of the same prompt, all but its last token run once. And requests that
    started together sharing a prefix the prompt cache lacks (`shared`, made by the batch lane,
    sharing.py): members may join while it runs, and `target` may shrink to take one in.
    The batch lane runs the prefix once into `kv`; each member then starts as a row from a view
    of it. GPU thread only, after the loop thread made it.
    """

    size: int  # choices of the request; a shared group: 0 (members come as they come)
    target: int  # tokens prefilled once (a choice runs the prompt's last token itself for its first logits)
    kv: list[Any] | None = None  # the prefix's KV so far (None: not started)
    done: int = 0  # prefix tokens in `kv`
    cached: int = 0  # of those, served from the prompt cache
    inserted: int = 0  # members started from it
    waiting: list[Any] = field(default_factory=list)  # members' Sequences in the lane, waiting for the prefill
    shared: bool = False  # requests that share a prefix, not the choices of one

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
    grammar_text: str | None = None  # ... and the grammar it was compiled from (an engine group's ranks compile it too)
    logprobs: int | None = None  # None: none; else the chosen token's and this many alternatives (0-20)
    group: PrefillGroup | None = None  # a choice of an n > 1 request: its prompt is prefilled once
    priority: int = 0  # lower starts sooner; equal ones in the order they came (the scheduler's queue)
    media: MediaPrompt | None = None  # the prompt's images (gpu/media.py), for a vision-language model
    adapters: Stack = ()  # the LoRA adapters it runs under (models/adapter_bank.py); () the base model
    continues_text: bool = False  # a text completion: its reply's first space is kept (it follows the prompt's text)
    speculate: bool = True  # may decode with drafts where the model has them (False: the request opted out)
    # A continued reply (http/resume.py): the last `resumed` ids of `prompt` are output already
    # delivered, which the Sequence replays silently and counts as completion, not prompt
    resumed: int = 0
