"""gpu/checkpoints.py `rows_kv`: a batch row's KV for its checkpoint, as views into the batch's
cache, is what mlx-lm's `extract_cache` copies out, row by row, whatever each row's padding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load

from mlxd.engine.cache.kv_layout import after
from mlxd.engine.gpu.checkpoints import rows_kv


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Any:
    return load(str(tiny_model))[0]


def generating(model: Any, lengths: list[int], steps: int) -> tuple[BatchGenerator, list[int]]:
    """A batch of rows whose prompts have these lengths (so each row has its own left padding),
    every row past its first tokens."""
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    prompts = [[(7 * i + 3 * n) % 200 + 5 for i in range(n)] for n in lengths]
    uids = gen.insert(prompts, max_tokens=[100] * len(prompts))
    made = 0
    while made < steps * len(prompts):
        _, responses = gen.next()
        made += len(responses)
    return gen, uids


def test_a_rows_kv_views_hold_what_extract_cache_copies_out(model: Any) -> None:
    gen, uids = generating(model, [5, 17, 30], steps=6)
    views = rows_kv(gen, uids)
    copies = gen.extract_cache(uids)
    assert set(views) == set(uids)
    for uid in uids:
        (got, got_tokens), (want, want_tokens) = views[uid], copies[uid]
        assert list(got_tokens) == list(want_tokens)
        assert [c.offset for c in got] == [c.offset for c in want] and got[0].offset >= 6
        for g, w in zip(got, want, strict=True):
            assert mx.array_equal(g.state[0], w.state[0]).item() and mx.array_equal(g.state[1], w.state[1]).item()
        # a delta's part of it too (what a later checkpoint stages)
        start = got[0].offset - 3
        for g, w in zip(after(got, start, got[0].offset), after(want, start, want[0].offset), strict=True):
            assert g.keys.shape[2] == 3 and mx.array_equal(g.keys, w.keys).item()
    gen.close()


def test_a_row_the_batch_does_not_hold_comes_from_extract_cache(model: Any) -> None:
    """A row still in its prompt (not in the generating batch) is not cut from it."""
    gen, uids = generating(model, [9, 12], steps=2)
    late = gen.insert([[5, 6, 7, 8]], max_tokens=[50])[0]  # queued: not generating yet
    got = rows_kv(gen, [uids[0], late])
    assert got[late] == gen.extract_cache([late])[late]  # what mlx-lm holds for it (its prompt, no KV yet)
    assert got[uids[0]][0][0].offset == gen.extract_cache([uids[0]])[uids[0]][0][0].offset
    gen.close()
