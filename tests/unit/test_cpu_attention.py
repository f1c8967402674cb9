"""Batched decode attention split across CPU streams (engine/gpu/cpu_attention.py): the same
numbers as MLX's masked attention, for the calls it takes, through joins and leaves."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import base, llama
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxd.engine.gpu import cpu_attention as ca
from tests.unit.test_decode_attention import decode_rows, holey_step, random_llama


def masked_inputs(rows: int, heads: int, kv_heads: int, dim: int, length: int, dtype: mx.Dtype, seed: int = 1):
    """A batched decode step's attention inputs: keys a slice of a longer buffer (as the cache
    hands them over), each row's keys starting at its own left padding."""
    kq, kk, kv = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((rows, heads, 1, dim), key=kq).astype(dtype)
    k = mx.random.normal((rows, kv_heads, length + 40, dim), key=kk).astype(dtype)[:, :, :length, :]
    v = mx.random.normal((rows, kv_heads, length + 40, dim), key=kv).astype(dtype)[:, :, :length, :]
    starts = mx.array([(r * 7) % length for r in range(rows)])
    mask = (mx.arange(length)[None, :] >= starts[:, None]).reshape(rows, 1, 1, length)
    return q, k, v, mask


@pytest.mark.parametrize("rows,parts", [(1, 1), (2, 2), (5, 2), (7, 3), (8, 8), (32, 2)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_split_attention_is_mlxs_masked_attention(rows: int, parts: int, heads: int, kv_heads: int) -> None:
    q, k, v, mask = masked_inputs(rows, heads, kv_heads, 64, 45, mx.float32)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = ca.split_attention(q, k, v, mask, 0.125, parts)
    assert got.shape == want.shape == (rows, heads, 1, 64)
    assert mx.allclose(got, want, atol=1e-5).item()


def test_masked_keys_take_no_part() -> None:
    """Keys before a row's start change nothing in that row (they are another row's padding)."""
    q, k, v, mask = masked_inputs(4, 4, 2, 32, 20, mx.float32)
    noisy = mx.where(mask.reshape(4, 1, 20, 1), k, 1e4)
    assert mx.allclose(ca.split_attention(q, noisy, v, mask, 0.2, 2), ca.split_attention(q, k, v, mask, 0.2, 2),
                       atol=1e-5).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_each_dtype_is_checked_against_mlx_before_use(dtype: mx.Dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ca, "_verdicts", {})
    assert ca.check(9, 3, 64, dtype) is True
    assert ca._verdicts == {(9, 3, 64, dtype): True}  # asked once, remembered


def test_a_layout_that_differs_from_mlx_keeps_mlxs_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ca, "_verdicts", {})
    monkeypatch.setattr(ca, "attention", lambda q, k, v, mask, scale, stream=None: q * 0 + 1)
    assert ca.check(4, 2, 32, mx.float32) is False


def test_parts_follow_the_cores_the_rows_and_the_work() -> None:
    assert [ca.parts_for(rows, 400, 2) for rows in (1, 2, 3, 32)] == [1, 1, 1, 2]
    assert [ca.parts_for(rows, 1000, 2) for rows in (1, 2, 3, 32)] == [1, 2, 2, 2]
    assert [ca.parts_for(rows, 4000, 16) for rows in (1, 5, 32)] == [1, 5, ca.MOST_PARTS]
    assert ca.parts_for(8, 300, 1) == 1
    assert [ca.parts_for(16, keys, 16) for keys in (49, 50, 100, 200)] == [1, 1, 2, 4]  # 800 rows x keys a part


def test_only_a_batched_single_query_step_with_a_boolean_mask_suits() -> None:
    q = mx.zeros((2, 4, 1, 32))
    k = v = mx.zeros((2, 2, 9, 32))
    mask = mx.ones((2, 1, 1, 9), dtype=mx.bool_)
    batch = BatchKVCache([0, 3])
    assert ca.suits(q, k, v, batch, mask, None)
    assert not ca.suits(q, k, v, KVCache(), mask, None)  # the serial lane's cache: MLX's own attention
    assert not ca.suits(q, k, v, batch, "causal", None)
    assert not ca.suits(q, k, v, batch, mask.astype(mx.float32), None)  # an additive mask
    assert not ca.suits(q, k, v, batch, mask, mx.zeros((4,)))  # attention sinks
    assert not ca.suits(mx.zeros((2, 4, 3, 32)), k, v, batch, mx.ones((2, 1, 3, 9), dtype=mx.bool_), None)  # prefill
    assert not ca.suits(q.astype(mx.float16), k, v, batch, mask, None)  # dtypes that differ


def test_batched_decode_through_joins_and_leaves_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """mlx-lm's BatchGenerator with rows joining and leaving: the same tokens and log-probabilities
    with the model's attention routed through cpu_sdpa as through MLX's."""
    monkeypatch.setattr(llama, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    model = random_llama(9, hidden=192, heads=6)  # three query heads a key head, as SmolLM2
    want_tokens, want_logprobs = decode_rows(model)

    assert ca.check(6, 2, 32, mx.float32)  # before counting: the check runs split_attention too
    split: list[int] = []
    real = ca.split_attention
    monkeypatch.setattr(ca, "split_attention", lambda q, *a: split.append(a[-1]) or real(q, *a))
    monkeypatch.setattr(ca, "cores", lambda: 2)
    monkeypatch.setattr(ca, "KEYS_A_PART", 1)  # these rows are short: split them all the same
    assert ca.install(model) == ["mlx_lm.models.llama"]
    got_tokens, got_logprobs = decode_rows(model)

    assert split and set(split) <= {1, 2} and 2 in split  # it ran, in two parts where two rows or more
    assert got_tokens == want_tokens
    assert all(mx.allclose(a, b, atol=1e-4).item() for a, b in zip(got_logprobs, want_logprobs, strict=True))


def test_off_switch_leaves_the_model_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    monkeypatch.setenv(ca.ENV, "0")
    assert ca.install(random_llama(1, hidden=64, heads=4, layers=1)) == []
    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_a_batch_with_holes_is_split_too_with_its_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that refused drafts (spec/holes.py's HoleyKV) keep the split attention, which applies
    the step's mask as it is: the holes stay unseen, and the logits are MLX's own."""
    from mlxd.engine.spec.holes import HoleyKV

    monkeypatch.setattr(llama, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    model = random_llama(9, hidden=192, heads=6)
    want, _ = holey_step(model)

    assert ca.check(6, 2, 32, mx.float32)
    split: list[int] = []
    real = ca.split_attention
    monkeypatch.setattr(ca, "split_attention", lambda q, *a: split.append(a[-1]) or real(q, *a))
    monkeypatch.setattr(ca, "cores", lambda: 2)
    monkeypatch.setattr(ca, "KEYS_A_PART", 1)
    assert ca.install(model) == ["mlx_lm.models.llama"]
    got, caches = holey_step(model)
    assert type(caches[0]) is HoleyKV
    assert split == [2] * len(model.layers)  # the decode step after the holes, in two parts
    assert mx.allclose(got, want, atol=1e-4).item()
