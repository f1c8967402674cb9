"""The batch lane's one-op logit bias gives what mlx-lm's row-by-row processors give (CPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models import llama
from mlx_lm.sample_utils import make_logits_processors

from mlxd.engine.gpu.batch_bias import BiasedStepBatch, LogitBias, batch_bias
from tests.unit.tiny_llama import tiny_llama

VOCAB = 96


@pytest.fixture()
def model() -> llama.Model:
    return tiny_llama(11, VOCAB)


def generate(model: llama.Model, processors: list[list], vectorized: bool, steps: int = 12) -> tuple[list[list[int]], GenerationBatch]:
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    if vectorized:
        assert batch_bias(gen)
    prompts = [[(i * 7 + r * 13) % (VOCAB - 1) + 1 for i in range(10)] for r in range(len(processors))]
    uids = gen.insert(prompts, max_tokens=[steps] * len(prompts), logits_processors=processors)
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    while any(len(v) < steps for v in out.values()):
        for r in gen.next_generated():
            out[r.uid].append(int(r.token))
    batch = gen._generation_batch
    gen.close()
    return [out[uid] for uid in uids], batch


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_every_row_gets_its_own_bias_in_one_matrix(model: llama.Model, dtype: mx.Dtype) -> None:
    model.set_dtype(dtype)
    biases: list[dict[int, float]] = [{5: 100.0}, {7: 100.0, 5: -100.0}, {}, {3: -100.0}]
    got, batch = generate(model, [[LogitBias(b)] if b else [] for b in biases], vectorized=True)
    assert got[0] == [5] * 12 and got[1] == [7] * 12
    assert 3 not in got[3]
    assert type(batch) is BiasedStepBatch and batch._bias is not None and batch._bias.shape == (4, VOCAB)
    # mlx-lm's own logit_bias processors, row by row, give the same tokens for every row.
    want, plain = generate(model, [make_logits_processors(logit_bias=b or None) for b in biases], vectorized=False)
    assert type(plain) is GenerationBatch
    assert got == want


def test_the_matrix_follows_the_rows_that_stay(model: llama.Model) -> None:
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    batch_bias(gen)
    prompts = [[(i * 5 + r) % (VOCAB - 1) + 1 for i in range(8)] for r in range(3)]
    uids = gen.insert(prompts, max_tokens=[3, 30, 30],
                      logits_processors=[[LogitBias({9: 100.0})], [LogitBias({4: 100.0})], [LogitBias({6: 100.0})]])
    seen: dict[int, list[int]] = {uid: [] for uid in uids}
    for _ in range(12):
        for r in gen.next_generated():
            seen[r.uid].append(int(r.token))
    gen.close()
    assert seen[uids[0]] == [9, 9, 9]  # it left after 3 tokens; the others kept their own bias
    assert set(seen[uids[1]]) == {4} and set(seen[uids[2]]) == {6}
    assert len(seen[uids[1]]) == 12


def test_rows_with_penalties_take_mlx_lms_path_unchanged(model: llama.Model) -> None:
    def rows() -> list[list]:
        return [[LogitBias({5: 2.0}), *make_logits_processors(repetition_penalty=1.3)], [LogitBias({8: 3.0})]]

    got, batch = generate(model, rows(), vectorized=True)
    want, _ = generate(model, rows(), vectorized=False)
    assert got == want
    assert batch._bias is None  # never built: the step ran row by row


def test_a_generator_of_another_shape_is_left_alone() -> None:
    class Other:
        _generation_batch = object()

    assert batch_bias(Other()) is False  # type: ignore[arg-type]


def staggered(model: llama.Model, vectorized: bool) -> tuple[dict[int, list[int]], set[str]]:
    """Rows joining a running batch and leaving it at different steps; tokens by row, logprob dtypes."""
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    if vectorized:
        batch_bias(gen)
    prompt = lambda r, n: [(i * 3 + r * 17) % (VOCAB - 1) + 1 for i in range(n)]  # noqa: E731
    bias = lambda b: [LogitBias(b)] if vectorized else make_logits_processors(logit_bias=b)  # noqa: E731
    uids = gen.insert([prompt(0, 9), prompt(1, 14)], max_tokens=[4, 16],
                      logits_processors=[bias({5: 3.0, 9: -2.0}), bias({11: 2.5})])
    seen: dict[int, list[int]] = {}
    dtypes: set[str] = set()
    for step in range(24):
        if step == 3:
            uids += gen.insert([prompt(2, 6)], max_tokens=[10], logits_processors=[bias({7: 4.0})])
        for r in gen.next_generated():
            seen.setdefault(r.uid, []).append(int(r.token))
            dtypes.add(str(r.logprobs.dtype))
    gen.close()
    return {uids.index(uid): tokens for uid, tokens in seen.items()}, dtypes


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_rows_joining_and_leaving_a_running_batch_match_mlx_lm(model: llama.Model, dtype: mx.Dtype) -> None:
    model.set_dtype(dtype)
    got, got_dtypes = staggered(model, vectorized=True)
    want, want_dtypes = staggered(model, vectorized=False)
    assert [len(got[r]) for r in range(3)] == [4, 16, 10]
    assert got == want
    assert got_dtypes == want_dtypes == {str(dtype)}  # every step in the logits' own dtype
