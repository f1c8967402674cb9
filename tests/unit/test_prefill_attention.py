"""The prefill attention router (mlxd/engine/gpu/prefill_attention.py): its unfused attention
equals MLX's, and which chunks it would send to cuDNN."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxd.engine.gpu import prefill_attention as pa


def qkv(batch: int, heads: int, kv_heads: int, q_len: int, k_len: int, dim: int = 32) -> tuple[mx.array, ...]:
    kq, kk, kv = mx.random.split(mx.random.key(3), 3)
    return (mx.random.normal((batch, heads, q_len, dim), key=kq), mx.random.normal((batch, kv_heads, k_len, dim), key=kk),
            mx.random.normal((batch, kv_heads, k_len, dim), key=kv))


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_unfused_causal_attention_equals_mlxs_over_a_cached_prefix(heads: int, kv_heads: int) -> None:
    q, k, v = qkv(1, heads, kv_heads, 5, 12)  # 5 new queries after 7 cached keys
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal")
    assert mx.allclose(pa.unfused(q, k, v, 0.3, "causal"), want, atol=1e-5).item()


@pytest.mark.parametrize("per_head", [False, True])
def test_unfused_attention_with_an_array_mask_equals_mlxs(per_head: bool) -> None:
    q, k, v = qkv(2, 8, 2, 4, 9)
    shape = (2, 8 if per_head else 1, 4, 9)
    mask = mx.random.uniform(shape=shape, key=mx.random.key(1)) > 0.3
    mask = mask | (mx.arange(9)[None, None, None, :] == 0)  # every query sees a key
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    assert mx.allclose(pa.unfused(q, k, v, 0.2, mask), want, atol=1e-5).item()
    additive = mx.where(mask, 0.0, -1e9)
    assert mx.allclose(pa.unfused(q, k, v, 0.2, additive), want, atol=1e-5).item()


def test_aligned_full_chunks_padded_last_chunks_and_heavy_ones_go_to_cudnn_the_rest_unfused() -> None:
    c = pa.aligned_chunk
    k = mx.zeros((1, 8, 3 * c, 64))
    assert pa.plan(mx.zeros((1, 32, c, 64)), k, "causal") == ("aligned", 0)  # few shapes: built once each
    # A prompt's last partial chunk after aligned ones: padded to the next BUCKET.
    assert pa.plan(mx.zeros((1, 32, 1855, 64)), mx.zeros((1, 8, 2 * c + 1855, 64)), "causal") == ("padded", 193)
    assert pa.plan(mx.zeros((1, 32, 1792, 64)), mx.zeros((1, 8, c + 1792, 64)), "causal") == ("padded", 0)
    # ... but not a short prompt's one cheap chunk, nor without a causal mask (padded keys would be seen).
    assert pa.plan(mx.zeros((1, 32, 300, 64)), mx.zeros((1, 8, 300, 64)), "causal") == ("unfused", 0)
    assert pa.plan(mx.zeros((1, 32, 1855, 64)), mx.zeros((1, 8, 2 * c + 1855, 64)), None) == ("unfused", 0)
    # An unaligned full chunk, a chunk after a cached prefix at an unaligned position: unfused.
    assert pa.plan(mx.zeros((1, 32, c, 64)), mx.zeros((1, 8, 3 * c + 5, 64)), "causal") == ("unfused", 0)
    assert pa.plan(mx.zeros((1, 32, 700, 64)), mx.zeros((1, 8, 800, 64)), "causal") == ("unfused", 0)
    # A chunk over a long context at an unaligned position: its unfused attention would outlast a graph build.
    assert pa.plan(mx.zeros((1, 32, 1500, 64)), mx.zeros((1, 8, 24_005, 64)), "causal") == ("graph", 0)
    assert pa.plan(mx.zeros((4, 32, c, 64)), mx.zeros((4, 8, 2 * c, 64)), mx.zeros((4, 1, c, 2 * c)))[0] == "unfused"


@pytest.mark.parametrize(("q_len", "cached"), [(37, 64), (50, 128), (64, 128)])
def test_a_padded_last_chunk_gives_what_the_unpadded_one_does(q_len: int, cached: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Real queries never see the zero keys padded after them (the mask is causal): the cut-back
    # output is the unpadded attention's. On the CPU MLX's own attention stands in for cuDNN's.
    monkeypatch.setattr(pa, "aligned_chunk", 64)
    monkeypatch.setattr(pa, "BUCKET", 16)
    monkeypatch.setattr(pa, "CUDNN_BUCKET_MIN_WORK", 1)
    monkeypatch.setattr(pa, "_cudnn", True)
    q, k, v = (x.astype(mx.float16) for x in qkv(1, 8, 2, q_len, cached + q_len))
    calls: list[tuple[int, ...]] = []

    def original(queries: mx.array, keys: mx.array, values: mx.array, **kw: object) -> mx.array:
        calls.append((queries.shape[2], keys.shape[2]))
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=kw["scale"], mask=kw["mask"])

    out = pa.route(original, q, k, v, None, 0.25, "causal", None)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    pad = -q_len % 16
    assert calls == [(q_len + pad, cached + q_len + pad)] and out.shape == want.shape
    assert mx.allclose(out.astype(mx.float32), want.astype(mx.float32), atol=2e-3).item()


def test_decode_steps_and_unsupported_chunks_are_not_routed() -> None:
    q, k, v = qkv(1, 4, 4, 1, 10)
    assert not pa.eligible(q, k, v, None)  # one query: a decode step
    q2 = mx.zeros((1, 4, 3, 160), dtype=mx.bfloat16)
    assert not pa.eligible(q2, mx.zeros((1, 4, 9, 160), dtype=mx.bfloat16), mx.zeros((1, 4, 9, 160), dtype=mx.bfloat16),
                           None)  # head size over cuDNN's 128


def test_a_wide_chunks_scores_are_made_a_group_of_rows_at_a_time() -> None:
    """Eight rows of 4,574-token prompts prefilled together by an 8B model (32 heads, 2048-query
    chunks, bf16) made 4.5 GiB of scores in one operation, which ran an H100 out of memory: its
    rows go one at a time (0.56 GiB each), small chunks stay whole."""
    assert pa.row_groups(8, 32, 2048, 4574, 2) == [(i, i + 1) for i in range(8)]
    assert pa.row_groups(8, 32, 512, 1000, 2) == [(0, 8)]  # 250 MiB in all
    assert pa.row_groups(5, 8, 64, 64, 4, block_bytes=2 * 8 * 64 * 64 * 4) == [(0, 2), (2, 4), (4, 5)]
    assert pa.row_groups(3, 8, 64, 64, 4, block_bytes=1) == [(0, 1), (1, 2), (2, 3)]  # a row at least


@pytest.mark.parametrize("mask_kind", ["causal", "rows", "shared", "none"])
def test_attention_a_group_of_rows_at_a_time_equals_the_whole(mask_kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = qkv(5, 8, 2, 4, 9)
    masks: dict[str, str | mx.array | None] = {
        "causal": "causal", "none": None,
        "rows": mx.arange(9)[None, None, None, :] >= mx.array([0, 1, 3, 0, 2])[:, None, None, None],  # left padding
        "shared": mx.arange(9)[None, None, None, :] >= 1}
    mask = masks[mask_kind]
    whole = pa.unfused(q, k, v, 0.2, mask)
    monkeypatch.setattr(pa, "SCORES_BLOCK_BYTES", 2 * 8 * 4 * 9 * 4)  # two rows' scores (float32)
    assert pa.row_groups(5, 8, 4, 9, 4) == [(0, 2), (2, 4), (4, 5)]
    grouped = pa.unfused(q, k, v, 0.2, mask)
    assert grouped.shape == whole.shape == (5, 8, 4, 32)
    assert mx.allclose(grouped, whole, atol=1e-6).item()
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    assert mx.allclose(grouped, want, atol=1e-5).item()


def test_an_additive_float32_mask_sizes_the_groups_by_its_wider_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 scores plus a float32 mask are float32: the groups are sized by 4 bytes a score."""
    q, k, v = (x.astype(mx.bfloat16) for x in qkv(4, 8, 2, 4, 9))
    seen: list[int] = []
    real = pa.row_groups

    def spy(rows: int, heads: int, q_len: int, k_len: int, itemsize: int, block_bytes: int | None = None) -> list[tuple[int, int]]:
        seen.append(itemsize)
        return real(rows, heads, q_len, k_len, itemsize, block_bytes)

    monkeypatch.setattr(pa, "row_groups", spy)
    additive = mx.where(mx.arange(9)[None, None, None, :] >= mx.array([0, 1, 2, 3])[:, None, None, None], 0.0, -1e9)
    pa.unfused(q, k, v, 0.2, additive.astype(mx.float32))
    pa.unfused(q, k, v, 0.2, additive > -1)  # a boolean mask keeps the queries' size
    assert seen == [4, 2]
