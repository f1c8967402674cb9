"""`--warmup`: run what the first users will, through the lanes, before the engine reports ready.

MLX's CUDA backend compiles kernels at run time: each kernel the first time it is used (NVRTC,
a second or more each), and a CUDA graph for each new shape. A batched decode step has a new
shape for every number of rows, and the first request with penalties, with a temperature, or
that finds its prefix in the prompt cache uses kernels no request before it did: on an H200
each of those stalled every running stream for seconds.

So the warm-up sends real jobs through the gateway's own turns (the same lanes, samplers,
prompt cache and hand-over as requests): one alone in the serial lane; one that continues
its prefix; then one more, and `width - 1` arriving while it runs, which join the batch lane
with prompts of different lengths (padded prefill), some continuing the cached prefix, with
greedy, temperature/top-p/top-k/min-p, penalty and logit-bias and seeded sampling, replies
ending a step apart so that the decode step runs at every width from `width` down to 1. Their
answers go nowhere. `auto` warms up where kernels are compiled at run time (CUDA); Metal and
CPU start at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import mlx.core as mx

from mlxd.engine.gpu.job import Job, SamplingParams
from mlxd.engine.gpu.sequence import Sequence
from mlxd.engine.gpu.ticket import Ticket

if TYPE_CHECKING:
    from mlxd.engine.gpu.runner import Runner
    from mlxd.engine.models.load_meter import LoadMeter
    from mlxd.engine.models.loaded_model import LoadedModel

log = logging.getLogger("mlxd.engine")

PREFIX_TOKENS = 64
NEW_TOKENS = 4
SAMPLINGS = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05),
    SamplingParams(temperature=0.0, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5,
                   logit_bias={1: -5.0}),
    SamplingParams(temperature=0.8, seed=7),
)


def wanted(mode: str) -> bool:
    """Whether `--warmup MODE` (on, off, auto) warms up on this machine."""
    if mode == "auto":
        return bool(mx.cuda.is_available())
    return mode == "on"


def _prompt(vocab_size: int, n: int, salt: int) -> list[int]:
    top = max(2, vocab_size - 1)
    return [(i * 7919 + salt * 104729) % (top - 1) + 1 for i in range(n)]


def waves(vocab_size: int, width: int) -> list[list[Job]]:
    """The warm-up's jobs, in waves: each wave is sent when the one before has ended.

    Wave 1: one job alone (the serial lane; its KV goes to the prompt cache). Wave 2: one that
    continues it (a cached prefix in the serial lane). Wave 3: a new job, then `width - 1` more
    sent a turn later (the batch lane; the serial job moves in with them), every other one
    continuing wave 2's prompt (a cached prefix in the batch lane).
    """
    loop = asyncio.new_event_loop()
    loop.close()  # tickets of a closed loop drop their events: nobody waits for these answers

    def job(prompt: list[int], max_tokens: int, sampling: SamplingParams) -> Job:
        return Job(prompt=prompt, max_tokens=max_tokens, sampling=sampling, stops=[], ticket=Ticket(loop))

    prefix = _prompt(vocab_size, PREFIX_TOKENS, 0)
    first = job(prefix, NEW_TOKENS, SAMPLINGS[0])
    follow_up = job(prefix + _prompt(vocab_size, 8, 1), NEW_TOKENS, SAMPLINGS[0])
    lead = job(_prompt(vocab_size, PREFIX_TOKENS, 2), NEW_TOKENS + width, SAMPLINGS[0])
    rest = []
    for i in range(1, width):
        # Lengths differ, so prefill is padded; odd rows share the cached prefix.
        head = prefix if i % 2 else _prompt(vocab_size, PREFIX_TOKENS // 2, 100 + i)
        prompt = head + _prompt(vocab_size, 4 + i, 200 + i)
        rest.append(job(prompt, NEW_TOKENS + i, SAMPLINGS[i % len(SAMPLINGS)]))
    return [[first], [follow_up], [lead, *rest]]


def warm_up(runner: Runner, loaded: LoadedModel, width: int, meter: LoadMeter) -> tuple[float, int, int]:
    """Run the waves through `runner`'s own turns: seconds, jobs, most rows at once."""
    started, jobs, most, level = time.perf_counter(), 0, 0, log.level
    log.setLevel(logging.WARNING)  # its jobs' own lines would read as requests
    all_waves = waves(loaded.vocab_size, width)
    meter.begin("warmup", sum(len(wave) for wave in all_waves))
    for wave in all_waves:
        seqs = [Sequence(job, loaded.tokenizer, loaded.eos_token_ids) for job in wave]
        jobs += len(seqs)
        runner.enqueue(seqs[0])
        runner.turn()  # the first job of a wave starts alone
        for seq in seqs[1:]:
            runner.enqueue(seq)
        while runner.has_work:
            runner.turn()
            most = max(most, runner.num_rows)
        meter.advance(len(wave))
    mx.synchronize()
    log.setLevel(level)
    return time.perf_counter() - started, jobs, most
