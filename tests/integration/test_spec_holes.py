"""The batch KV with holes (mlxd/engine/spec/holes.py) on a real tiny model, in process.

Rows of a batch are fed tokens that some of them then drop (refused drafts); every later pass
must give each row the logits a cache holding only its kept tokens gives, through rows
leaving (`filter`), joining (`extend`), ending (`extract`), a `trim`, and a compaction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from mlxd.engine.spec.holes import HoleyKV, punch

PROMPTS = [[5, 17, 3, 99, 42, 8], [7, 7, 12], [30, 31, 32, 33, 34, 35, 36, 37, 38]]


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Any:
    from mlx_lm.utils import load

    return load(str(tiny_model))[0]


def batch(model: Any, prompts: list[list[int]]) -> list[Any]:
    """A left-padded batch cache holding `prompts`."""
    width = max(len(p) for p in prompts)
    caches = [BatchKVCache([width - len(p) for p in prompts]) for _ in model.layers]
    model(mx.array([[0] * (width - len(p)) + p for p in prompts]), cache=caches)
    return caches


def alone(model: Any, tokens: list[int], nxt: int) -> mx.array:
    """The logits after `tokens` then `nxt`, from a cache of that row alone."""
    cache = make_prompt_cache(model)
    return model(mx.array([[*tokens, nxt]]), cache=cache)[0, -1]


def close(a: mx.array, b: mx.array) -> bool:
    return bool(mx.allclose(a, b, atol=1e-4, rtol=1e-4).item())


def test_refused_tokens_are_never_seen_and_rows_keep_their_positions(model: Any) -> None:
    caches = batch(model, PROMPTS)
    fed = [[50, 51, 52, 53], [60, 61, 62, 63], [70, 71, 72, 73]]
    model(mx.array(fed), cache=caches)
    kept = [1, 4, 0]  # row 0 keeps one of the four, row 1 all, row 2 none
    punch(caches, [4 - k for k in kept])
    assert type(caches[0]) is HoleyKV
    history = [p + f[:k] for p, f, k in zip(PROMPTS, fed, kept, strict=True)]
    for _ in range(3):  # later steps, each row's next token in one pass
        nxt = [9, 10, 11]
        logits = model(mx.array(nxt)[:, None], cache=caches)[:, -1]
        for i in range(3):
            assert close(logits[i], alone(model, history[i], nxt[i])), i
            history[i].append(nxt[i])
        punch(caches, [0, 0, 0])  # nothing dropped: nothing changes


def test_leaving_joining_ending_and_compacting_keep_each_row_right(model: Any) -> None:
    caches = batch(model, PROMPTS)
    model(mx.array([[50, 51, 52], [60, 61, 62], [70, 71, 72]]), cache=caches)
    punch(caches, [2, 0, 1])
    history = [PROMPTS[0] + [50], PROMPTS[1] + [60, 61, 62], PROMPTS[2] + [70, 71]]
    # Row 1 leaves: extract gives its kept KV alone, then filter drops it.
    extracted = [c.extract(1) for c in caches]
    assert extracted[0].offset == len(history[1])
    assert close(model(mx.array([[4]]), cache=extracted)[0, -1], alone(model, history[1], 4))
    for c in caches:
        c.filter([0, 2])
    history = [history[0], history[2]]
    # A row joins with a plain batch cache of its own.
    joining = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 20, 21, 22]
    newcomer = batch(model, [joining])
    for c, o in zip(caches, newcomer, strict=True):
        c.extend(o)
    history.append(list(joining))
    nxt = [3, 4, 5]
    logits = model(mx.array(nxt)[:, None], cache=caches)[:, -1]
    for i in range(3):
        assert close(logits[i], alone(model, history[i], nxt[i])), i
        history[i].append(nxt[i])
    # A trim of the last pass, then the same pass again.
    for c in caches:
        c.trim(1)
    logits = model(mx.array(nxt)[:, None], cache=caches)[:, -1]
    for i in range(3):
        assert close(logits[i], alone(model, history[i][:-1], nxt[i])), i
    # Compaction: a plain batch cache again, the same answers.
    for c in caches:
        c.compact()
    assert type(caches[0]) is BatchKVCache
    nxt = [6, 7, 8]
    logits = model(mx.array(nxt)[:, None], cache=caches)[:, -1]
    for i in range(3):
        assert close(logits[i], alone(model, history[i], nxt[i])), i


def test_holes_past_a_quarter_of_the_buffer_are_compacted(model: Any) -> None:
    caches = batch(model, [[1] * 40, [2] * 40])
    history = [[1] * 40, [2] * 40]
    kinds = []
    for step in range(12):  # 8 fed, 1 kept by row 0 and 8 by row 1, a step
        fed = [[10 + step] * 8, [20 + step] * 8]
        model(mx.array(fed), cache=caches)
        punch(caches, [7, 0])
        history[0].append(10 + step)
        history[1].extend(fed[1])
        kinds.append(type(caches[0]).__name__)
    # 7 holes a step: past 64 and a quarter of 2 x (40 + 8 k) positions at the 10th step.
    assert kinds == ["HoleyKV"] * 9 + ["BatchKVCache"] + ["HoleyKV"] * 2
    assert caches[0].hole_count() == 14
    logits = model(mx.array([[3], [3]]), cache=caches)[:, -1]
    assert close(logits[0], alone(model, history[0], 3)) and close(logits[1], alone(model, history[1], 3))


class Unreadable:
    """A device array the host must not read (a read would wait for the GPU's step under way);
    slicing and arithmetic on it stay lazy and are allowed."""

    def __init__(self, array: mx.array) -> None:
        self.array = array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    def __getitem__(self, index: Any) -> Unreadable:
        return Unreadable(self.array[index])

    def __sub__(self, other: Any) -> Unreadable:
        return Unreadable(self.array - other)

    def tolist(self) -> Any:
        raise AssertionError("read on the host")

    def item(self) -> Any:
        raise AssertionError("read on the host")


def test_a_row_ending_and_rows_leaving_read_nothing_from_the_device(model: Any) -> None:
    """A row's kept KV (`extract`), a filter, the hole count and a trim take the holes and the
    rows' padding from the host's copies, and what they give is what the device's copies say."""
    caches = batch(model, PROMPTS)
    model(mx.array([[50, 51, 52], [60, 61, 62], [70, 71, 72]]), cache=caches)
    punch(caches, [2, 0, 1])
    history = [PROMPTS[0] + [50], PROMPTS[1] + [60, 61, 62], PROMPTS[2] + [70, 71]]
    for c in caches:
        assert c.host_padding.tolist() == c.left_padding.tolist()
        assert c.host_holes.tolist() == c.holes.tolist()
    padding = caches[0].left_padding.tolist()
    for c in caches:
        c.left_padding, c.holes = Unreadable(c.left_padding), Unreadable(c.holes)  # type: ignore[assignment]
    extracted = [c.extract(0) for c in caches]
    assert caches[0].hole_count() == 3
    for c in caches:
        c.filter([0, 2])
    left = [padding[0], padding[2]]
    assert caches[0].host_padding.tolist() == [p - min(left) for p in left]
    assert caches[0].host_holes.tolist() == caches[0].holes.array.tolist()  # the two copies still agree
    assert close(model(mx.array([[4]]), cache=extracted)[0, -1], alone(model, history[0], 4))
