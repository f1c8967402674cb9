"""Ended rows lingering in the batch (mlxd/engine/gpu/linger.py): the same tokens, the same KV,
and the rows leave together (real MLX on the CPU, a tiny random llama in this process)."""

from __future__ import annotations

import itertools
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import llama

from mlxd.engine.gpu import linger
from mlxd.engine.gpu.stats import Stats
from tests.unit.tiny_llama import tiny_llama

VOCAB = 96


@pytest.fixture()
def model() -> llama.Model:
    return tiny_llama(5, VOCAB)


def prompts(rows: int) -> list[list[int]]:
    return [[(i * 7 + r * 13) % (VOCAB - 1) + 1 for i in range(10 + r)] for r in range(rows)]


def run(model: llama.Model, max_tokens: list[int], lingering: bool, stats: Stats | None = None,
        ) -> tuple[dict[int, list[int]], dict[int, Any], list[int]]:
    """Every row to its end: its tokens, its last answer (the KV and tokens it leaves with), and
    the batch's row count after each step."""
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    if lingering:
        assert linger.attach(gen, stats)
    uids = gen.insert(prompts(len(max_tokens)), max_tokens=max_tokens)
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    last: dict[int, Any] = {}
    widths: list[int] = []
    while len(last) < len(uids):
        for r in gen.next_generated():
            if r.uid in last:  # a lingering row's token: nobody's
                continue
            tokens[r.uid].append(int(r.token))
            if r.finish_reason is not None:
                last[r.uid] = r
        widths.append(len(gen._generation_batch))
    gen.close()
    order = sorted(uids)
    return ({i: tokens[u] for i, u in enumerate(order)}, {i: last[u] for i, u in enumerate(order)}, widths)


def test_rows_that_linger_give_the_tokens_and_kv_of_rows_that_leave(model: llama.Model) -> None:
    """Rows ending a few steps apart (all due within LINGER_STEPS of each other, never more
    ended than running) stay until the last of them end; each still gets the tokens, the token
    list and the KV it gets when rows leave as they end, and the batch never shrinks before it
    empties."""
    limits = [6, 8, 12, 12]
    stats = Stats()
    want, want_last, want_widths = run(model, limits, lingering=False)
    got, got_last, got_widths = run(model, limits, lingering=True, stats=stats)
    assert got == want
    assert stats.rows_lingered == 2
    assert {4, 3, 2} <= set(want_widths)  # leaving: the batch shrinks row by row
    assert set(got_widths) == {4, 0}  # lingering: it stays whole, then empties
    for i, limit in enumerate(limits):
        assert len(got[i]) == limit
        assert got_last[i].all_tokens == want_last[i].all_tokens  # not grown by the steps it lingered
        for ours, theirs in zip(got_last[i].prompt_cache, want_last[i].prompt_cache, strict=True):
            assert ours.offset == theirs.offset
            # the same KV up to rounding: a step of 4 rows and one of 3 may round a row's sums
            # differently (OpenBLAS picks its kernels by shape, and by the CPU it runs on)
            assert mx.allclose(ours.state[0], theirs.state[0], rtol=1e-5, atol=1e-5).item()
            assert mx.allclose(ours.state[1], theirs.state[1], rtol=1e-5, atol=1e-5).item()


def test_a_row_ending_with_no_live_row_due_soon_leaves_at_once(model: llama.Model) -> None:
    """The others are far from their limits: nothing lingers, the batch shrinks as it does
    without lingering."""
    limits = [6, 6 + linger.LINGER_STEPS + 8, 6 + linger.LINGER_STEPS + 9]
    stats = Stats()
    want, _, _ = run(model, limits, lingering=False)
    got, _, got_widths = run(model, limits, lingering=True, stats=stats)
    assert got == want
    assert stats.rows_lingered == 1  # the second row lingers for the third, due a step later
    assert got_widths[:len(limits) + 8].count(2) > 0  # the first left at once


def test_ghosts_never_outnumber_the_live_rows(model: llama.Model) -> None:
    """Five rows end while one due row is left: the ones that would outnumber it leave in one
    gather with it (the batch goes 6 -> 1 at once, not row by row)."""
    limits = [4, 4, 5, 5, 6, 6 + linger.LINGER_STEPS - 2]
    stats = Stats()
    want, _, _ = run(model, limits, lingering=False)
    got, _, got_widths = run(model, limits, lingering=True, stats=stats)
    assert got == want
    decoding = got_widths[got_widths.index(6):]  # from the first step all six decode
    assert [w for a, w in itertools.pairwise(decoding) if w != a] == [2, 0], got_widths
    assert stats.rows_lingered == 2 + 1  # two at step 4 (then flushed with two more), one at step 6


def test_a_removed_row_lingers_and_a_joining_row_flushes_the_ghosts(model: llama.Model) -> None:
    """A row the lane removes (a stop string it found, a client gone) lingers like one mlx-lm
    ended; its tokens keep coming under its uid and never end it; a row inserted after them
    joins a batch the ghosts have left, and decodes what it decodes alone."""
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    assert linger.attach(gen)
    a, b = gen.insert(prompts(2), max_tokens=[40, 10])
    for _ in range(4):
        gen.next_generated()
    gen.remove([a])  # b is due in 6 steps: a stays
    assert len(gen._generation_batch) == 2 and linger.ghosts(gen) == 1
    seen_a = 0
    for _ in range(3):
        for r in gen.next_generated():
            if r.uid == a:
                seen_a += 1
                assert r.finish_reason is None
    assert seen_a == 3
    linger.flush(gen)
    assert len(gen._generation_batch) == 1 and linger.ghosts(gen) == 0
    gen.remove([b])  # no live row left: the batch empties
    assert len(gen._generation_batch) == 0
    (c,) = gen.insert([prompts(3)[2]], max_tokens=[5])
    out = []
    while len(out) < 5:
        out += [int(r.token) for r in gen.next_generated() if r.uid == c]
    gen.close()
    alone = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    (d,) = alone.insert([prompts(3)[2]], max_tokens=[5])
    want = []
    while len(want) < 5:
        want += [int(r.token) for r in alone.next_generated() if r.uid == d]
    alone.close()
    assert out == want


def test_it_is_on_where_a_gpu_runs_and_the_environment_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(linger.ENV, raising=False)
    assert linger.enabled() is (mx.default_device() == mx.gpu)
    monkeypatch.setenv(linger.ENV, "1")
    assert linger.enabled() is True
    monkeypatch.setenv(linger.ENV, "0")
    assert linger.enabled() is False


def test_a_generator_of_another_shape_is_left_alone() -> None:
    class Other:
        _generation_batch = object()

    assert linger.attach(Other()) is False
    assert linger.ghosts(Other()) == 0


def test_a_lingering_rows_tokens_do_not_count_for_the_batchs_pace() -> None:
    """The drafting batch times its tokens per second (spec/pace.py): a ghost's tokens are
    nobody's, so they do not make a step look more productive."""
    from types import SimpleNamespace

    from mlxd.engine.spec.batch import drafting_batch

    batch = drafting_batch(object)()
    out = [SimpleNamespace(uid=uid) for uid in (1, 2, 3)]
    assert batch._counted(out) == 3
    batch.ghosts = frozenset({3})
    assert batch._counted(out) == 2
