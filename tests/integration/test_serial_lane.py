"""The serial lane's chunked prefill (mlxd/engine/gpu/serial_lane.py) and the Runner's turns,
in process on the tiny random model: a prompt is prefilled a chunk a step, and the tokens are
those mlx-lm's generate_step gives for the whole prompt at once (the lane's earlier way)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.gpu import first_pass
from mlxd.engine.gpu.job import Job, SamplingParams
from mlxd.engine.gpu.options import GatewayOptions
from mlxd.engine.gpu.runner import Runner
from mlxd.engine.gpu.sampling import PENALTY_CONTEXT, shared_sampler
from mlxd.engine.gpu.sequence import Sequence
from mlxd.engine.gpu.serial_lane import SerialLane
from mlxd.engine.gpu.stats import Stats
from mlxd.engine.gpu.ticket import Ticket
from mlxd.engine.models.loaded_model import LoadedModel

STEP = 128
GREEDY = SamplingParams(temperature=0.0)


def prompt_of(tiny_loaded: LoadedModel, n: int, salt: int = 0) -> list[int]:
    rng = random.Random(salt)
    return [rng.randrange(1, tiny_loaded.vocab_size) for _ in range(n)]


def sequence(tiny_loaded: LoadedModel, loop: asyncio.AbstractEventLoop, prompt: list[int], max_tokens: int,
             sampling: SamplingParams = GREEDY) -> Sequence:
    job = Job(prompt, max_tokens, sampling, [], Ticket(loop))
    return Sequence(job, tiny_loaded.tokenizer, set())  # no EOS: every run goes to max_tokens


def run_lane(lane: SerialLane, seq: Sequence) -> int:
    """Step the lane until `seq` ends; the steps before its first token."""
    lane.admit(seq)
    steps_before_first = 0
    while not lane.step():
        if not seq.generated:
            steps_before_first += 1
    return steps_before_first


def reference(tiny_loaded: LoadedModel, prompt: list[int], max_tokens: int, step: int = STEP, **kwargs: object) -> list[int]:
    """generate_step on the whole prompt: what the serial lane ran before it prefilled in chunks."""
    steps = generate_step(mx.array(prompt), tiny_loaded.model, max_tokens=max_tokens, sampler=shared_sampler(0.0, 1.0, 0.0, 0),
                          prefill_step_size=step, **kwargs)  # type: ignore[arg-type]
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize(("num_prompt", "last_row", "before_first"), [
    (5, False, 0), (STEP + 1, False, 0), (STEP + 2, False, 0), (5 * STEP + 37, False, 5),
    (5, True, 0), (STEP + 1, True, 0), (STEP + 2, True, 0), (5 * STEP + 37, True, 4),
])
def test_a_chunked_prefill_gives_generate_steps_tokens(
    tiny_model: Path, closed_loop: asyncio.AbstractEventLoop, num_prompt: int, last_row: bool, before_first: int
) -> None:
    tiny = LoadedModel(tiny_model, "tiny")  # its own: whether the projection is changed is this test's
    if last_row:
        assert first_pass.install(tiny.model)
    prompt = prompt_of(tiny, num_prompt)
    lane = SerialLane(tiny, Stats(), STEP, PrefixCache(0))
    seq = sequence(tiny, closed_loop, prompt, 24)
    steps_before_first = run_lane(lane, seq)
    assert seq.generated == reference(tiny, prompt, 24)
    # A chunk a step, the last one with the first token. The prompt's last piece goes with the
    # first token: up to SHORT_PIECE tokens (5 + 128 * k + 1), or with the last-row projection up
    # to a chunk (the 37 after five chunks); else its last token does (after a chunk of 36).
    assert steps_before_first == before_first
    assert seq.finish_reason == "length" and not lane.has_work


def test_the_last_row_projection_makes_the_whole_passs_last_logits(tiny_model: Path, smollm2: Path) -> None:
    """first_pass.install: an lm_head (the tiny llama) or a tied embedding (SmolLM2) projects only
    the last position while a first pass runs, and the logits are the whole pass's."""
    for path in (tiny_model, smollm2):
        model = LoadedModel(path, "m").model
        tokens = mx.array([prompt_of_size(200, 40)])
        whole = model(tokens, cache=make_prompt_cache(model))
        assert first_pass.install(model) and first_pass.installed(model)
        assert model(tokens, cache=make_prompt_cache(model)).shape == whole.shape  # off outside a first pass
        with first_pass.last_row_only():
            last = model(tokens, cache=make_prompt_cache(model))
        assert last.shape == (1, 1, whole.shape[-1])
        assert mx.allclose(last[0, -1], whole[0, -1], atol=1e-4).item()


def prompt_of_size(vocab: int, n: int) -> list[int]:
    return [(i * 7919) % (vocab - 1) + 1 for i in range(n)]


def test_quantized_kv_and_penalties_give_generate_steps_tokens_too(
    smollm2: Path, closed_loop: asyncio.AbstractEventLoop
) -> None:
    smol = LoadedModel(smollm2, "smol")  # the tiny model's heads are too narrow to quantize
    step = 32  # three chunks; SmolLM2's quantized attention is slow on the CPU
    prompt = prompt_of(smol, 3 * step + 5, salt=1)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5)
    lane = SerialLane(smol, Stats(), step, PrefixCache(0), kv_bits=4, kv_group_size=64)
    seq = sequence(smol, closed_loop, prompt, 8, params)
    run_lane(lane, seq)
    processors = make_logits_processors(repetition_penalty=1.3, repetition_context_size=PENALTY_CONTEXT,
                                        frequency_penalty=0.5, frequency_context_size=PENALTY_CONTEXT)
    want = reference(smol, prompt, 8, step, logits_processors=processors, kv_bits=4, kv_group_size=64,
                     quantized_kv_start=0)
    assert seq.generated == want


def test_a_penalty_looks_back_over_the_window_the_request_sets(
    tiny_loaded: LoadedModel, closed_loop: asyncio.AbstractEventLoop
) -> None:
    prompt = prompt_of(tiny_loaded, 40, salt=5)
    out = {}
    for window in (2, PENALTY_CONTEXT):
        params = SamplingParams(temperature=0.0, repetition_penalty=5.0, repetition_context_size=window)
        seq = sequence(tiny_loaded, closed_loop, prompt, 24, params)
        run_lane(SerialLane(tiny_loaded, Stats(), STEP, PrefixCache(0)), seq)
        processors = make_logits_processors(repetition_penalty=5.0, repetition_context_size=window)
        assert seq.generated == reference(tiny_loaded, prompt, 24, logits_processors=processors), window
        out[window] = seq.generated
    assert out[2] != out[PENALTY_CONTEXT]  # the window changed what was penalised


def test_a_cancel_during_the_prefill_ends_it_at_the_next_chunk_and_keeps_its_kv(
    tiny_loaded: LoadedModel, closed_loop: asyncio.AbstractEventLoop
) -> None:
    prompt = prompt_of(tiny_loaded, 6 * STEP, salt=2)
    cache = PrefixCache(64 * 1024 * 1024)
    lane = SerialLane(tiny_loaded, Stats(), STEP, cache)
    seq = sequence(tiny_loaded, closed_loop, prompt, 8)
    lane.admit(seq)
    assert lane.step() == [] and lane.step() == []  # two chunks
    seq.job.ticket.cancel()
    assert lane.step() == [seq] and seq.finish_reason == "cancelled" and not seq.generated
    assert cache.fetch(prompt)[1] == 2 * STEP  # a retry finds the prefill so far


def test_a_job_arriving_during_a_long_serial_prefill_starts_between_its_chunks(
    tiny_loaded: LoadedModel, closed_loop: asyncio.AbstractEventLoop
) -> None:
    opts = GatewayOptions(prefill_step=STEP, batch=2)
    runner = Runner(tiny_loaded, Stats(), opts, 100_000, PrefixCache(0))
    long = sequence(tiny_loaded, closed_loop, prompt_of(tiny_loaded, 8 * STEP, salt=3), 4)
    short = sequence(tiny_loaded, closed_loop, prompt_of(tiny_loaded, 16, salt=4), 4)
    runner.enqueue(long)
    assert runner.turn() == 1 and runner.rows_in("serial") == 1
    runner.enqueue(short)
    assert runner.turn() == 1 and runner.rows_in("batch") == 1
    assert not long.generated  # still prefilling: the short job did not wait for it
    while runner.has_work:
        runner.turn()
    assert (len(long.generated), len(short.generated)) == (4, 4)
    assert runner.scheduler.kv.booked == 0


def test_an_urgent_job_is_prefilled_alone_between_batched_steps_then_joins_the_batch(
    tiny_loaded: LoadedModel, closed_loop: asyncio.AbstractEventLoop
) -> None:
    opts = GatewayOptions(prefill_step=STEP, batch=4)
    runner = Runner(tiny_loaded, Stats(), opts, 100_000, PrefixCache(0))

    def job(salt: int, max_tokens: int, priority: int) -> Sequence:
        seq = Sequence(Job(prompt_of(tiny_loaded, 40, salt=salt), max_tokens, GREEDY, [], Ticket(closed_loop),
                           priority=priority), tiny_loaded.tokenizer, set())
        runner.enqueue(seq)
        return seq

    background = [job(10, 30, 10), job(11, 30, 10)]
    while not all(seq.generated for seq in background):
        runner.turn()
    assert runner.rows_in("batch") == 2
    urgent = job(12, 6, 0)
    runner.turn()
    # It took the free serial lane though the batch runs, and its one-chunk prompt gave its
    # first token in that same turn.
    assert (runner.rows_in("serial"), len(urgent.generated)) == (1, 1)
    runner.turn()
    assert (runner.rows_in("serial"), runner.rows_in("batch")) == (0, 3)  # then it joined the batch
    same = job(13, 6, 10)  # no more urgent than what runs: the batch lane, as before
    runner.turn()
    assert (runner.rows_in("serial"), runner.rows_in("batch")) == (0, 4)
    while runner.has_work:
        runner.turn()
    assert urgent.generated == reference(tiny_loaded, urgent.job.prompt, 6)
    assert same.generated == reference(tiny_loaded, same.job.prompt, 6)
    assert all(seq.generated == reference(tiny_loaded, seq.job.prompt, 30) for seq in background)
    assert runner.scheduler.kv.booked == 0
