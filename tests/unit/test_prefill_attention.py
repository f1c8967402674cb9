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


def test_aligned_full_chunks_and_heavy_ones_go_to_cudnn_the_rest_unfused() -> None:
    c = pa.aligned_chunk
    k = mx.zeros((1, 8, 3 * c, 64))
    assert pa.wants_cudnn(mx.zeros((1, 32, c, 64)), k, "causal") == (True, True)  # few shapes: built once each
    assert pa.wants_cudnn(mx.zeros((1, 32, c, 64)), mx.zeros((1, 8, 3 * c + 5, 64)), "causal")[0] is False
    assert pa.wants_cudnn(mx.zeros((1, 32, 700, 64)), mx.zeros((1, 8, 800, 64)), "causal") == (False, False)
    # A last partial chunk over a long context: its unfused attention would outlast a graph build.
    assert pa.wants_cudnn(mx.zeros((1, 32, 1500, 64)), mx.zeros((1, 8, 24_000, 64)), "causal") == (True, False)
    assert pa.wants_cudnn(mx.zeros((4, 32, c, 64)), mx.zeros((4, 8, 2 * c, 64)), mx.zeros((4, 1, c, 2 * c)))[0] is False


def test_decode_steps_and_unsupported_chunks_are_not_routed() -> None:
    q, k, v = qkv(1, 4, 4, 1, 10)
    assert not pa.eligible(q, k, v, None)  # one query: a decode step
    q2 = mx.zeros((1, 4, 3, 160), dtype=mx.bfloat16)
    assert not pa.eligible(q2, mx.zeros((1, 4, 9, 160), dtype=mx.bfloat16), mx.zeros((1, 4, 9, 160), dtype=mx.bfloat16),
                           None)  # head size over cuDNN's 128
