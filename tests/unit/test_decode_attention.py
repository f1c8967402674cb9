"""The fused decode attention's routing (the kernel itself needs CUDA: benchmarks/masked_decode_attention.py
checks it there, and the engine checks it against MLX's attention before first use)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import base, llama
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from mlxd.engine.gpu import decode_attention as da
from mlxd.engine.spec.holes import become_holey


def random_llama(seed: int, hidden: int, heads: int, kv_heads: int = 2, layers: int = 2) -> llama.Model:
    """A small random-weight llama (vocabulary of 50), its weights evaluated."""
    mx.random.seed(seed)
    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=2 * hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           rms_norm_eps=1e-5, vocab_size=50)
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


@pytest.fixture()
def model(monkeypatch: pytest.MonkeyPatch) -> llama.Model:
    # install() replaces a module global: put the original back after each test.
    monkeypatch.setattr(llama, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    return random_llama(5, hidden=64, heads=4)


def test_warp_counts_grow_with_the_context() -> None:
    assert [da.warps_for(n) for n in (1, 1024, 1025, 4096, 4097, 100_000)] == [4, 4, 8, 8, 16, 16]


def test_install_routes_the_models_own_module_and_falls_back_where_the_kernel_cannot_run(model: llama.Model) -> None:
    tokens = mx.array([[3, 4, 5, 6], [7, 8, 9, 10]])
    before_cache = [BatchKVCache([0, 1]) for _ in model.layers]
    model(tokens, cache=before_cache)
    expected = model(mx.array([[11], [12]]), cache=before_cache)

    assert da.install(model) == ["mlx_lm.models.llama"]
    assert llama.scaled_dot_product_attention is not base.scaled_dot_product_attention
    assert da.install(model) == []  # once is enough
    cache = [BatchKVCache([0, 1]) for _ in model.layers]
    model(tokens, cache=cache)
    got = model(mx.array([[11], [12]]), cache=cache)  # a batched decode step: on this CPU, MLX's attention serves
    assert mx.allclose(got, expected, atol=1e-5).item()


def test_only_a_batched_single_query_step_suits_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(da._verdicts, (4, 2, 32, mx.float16), True)  # as if checked on a GPU
    q = mx.zeros((2, 4, 1, 32), dtype=mx.float16)
    k = v = mx.zeros((2, 2, 9, 32), dtype=mx.float16)
    mask = mx.ones((2, 1, 1, 9), dtype=mx.bool_)
    batch = BatchKVCache([0, 3])
    assert da.suits(q, k, v, batch, mask, None)
    holey = BatchKVCache([0, 3])
    become_holey(holey)
    assert not da.suits(q, k, v, holey, mask, None)  # its masked variant not checked yet
    monkeypatch.setitem(da._masked_verdicts, (4, 2, 32, mx.float16), True)
    assert da.suits(q, k, v, holey, mask, None)
    assert not da.suits(q, k, v, KVCache(), mask, None)  # the serial lane's cache
    assert not da.suits(q, k, v, batch, "causal", None)  # not an array mask
    assert not da.suits(q, k, v, batch, mask, mx.zeros((4,)))  # attention sinks
    assert not da.suits(mx.zeros((2, 4, 3, 32), dtype=mx.float16), k, v, batch, mx.ones((2, 1, 3, 9), dtype=mx.bool_), None)
    assert not da.suits(q.astype(mx.float32), k, v, batch, mask, None)  # sizes not checked for float32
    wide = mx.zeros((2, 4, 1, 48), dtype=mx.float16)  # a head size the kernel does not take
    assert not da.suits(wide, mx.zeros((2, 2, 9, 48), dtype=mx.float16), mx.zeros((2, 2, 9, 48), dtype=mx.float16),
                        batch, mask, None)


@pytest.mark.skipif(mx.cuda.is_available(), reason="on CUDA the kernel builds and passes its check")
def test_a_kernel_that_cannot_be_built_keeps_mlxs_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(da, "_verdicts", {})
    assert da.check(6, 3, 64, mx.bfloat16) is False
    assert da._verdicts == {(6, 3, 64, mx.bfloat16): False}  # asked once, remembered


def test_models_with_other_caches_are_left_alone(model: llama.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model, "make_cache", lambda: [RotatingKVCache(max_size=16) for _ in model.layers], raising=False)
    assert not da.plain_causal(model)
    assert da.install(model) == []
    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_off_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(da.ENV, "0")
    assert da.enabled() is False


def decode_rows(model: llama.Model) -> tuple[list[list[int]], list[mx.array]]:
    """Staggered rows through mlx-lm's BatchGenerator: one joins a running batch, one leaves early."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    prompt = lambda r, n: [(i * 5 + r * 11) % 48 + 1 for i in range(n)]  # noqa: E731
    uids = gen.insert([prompt(0, 7), prompt(1, 19), prompt(2, 12)], max_tokens=[3, 14, 14])
    tokens: dict[int, list[int]] = {}
    logprobs: list[mx.array] = []
    for step in range(20):
        if step == 4:
            uids += gen.insert([prompt(3, 25)], max_tokens=[8])
        for r in gen.next_generated():
            tokens.setdefault(r.uid, []).append(int(r.token))
            logprobs.append(r.logprobs)
    gen.close()
    return [tokens[uid] for uid in uids], logprobs


def test_row_starts_say_what_mlx_lms_mask_says_through_joins_and_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's contract, checked where it cannot run: with MLX's masked attention standing in
    for it, fed only each row's start (the cache's left padding), a batch whose rows join and
    leave decodes exactly as mlx-lm's own masked path."""
    monkeypatch.setattr(llama, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    model = random_llama(9, hidden=128, heads=4)  # head size 32: one the kernel takes
    want_tokens, want_logprobs = decode_rows(model)

    routed: list[int] = []

    def stand_in(q: mx.array, k: mx.array, v: mx.array, starts: mx.array, scale: float, warps: int = 0,
                 keep: mx.array | None = None) -> mx.array:
        assert keep is None  # a plain batch: the row starts say it all
        routed.append(q.shape[0])
        return da.reference(q, k, v, starts, scale)

    monkeypatch.setattr(da, "fused", stand_in)
    monkeypatch.setattr(da, "check", lambda *_, **__: True)
    assert da.install(model) == ["mlx_lm.models.llama"]
    got_tokens, got_logprobs = decode_rows(model)
    assert got_tokens == want_tokens
    assert [len(t) for t in got_tokens] == [3, 14, 14, 8]
    assert all(mx.allclose(a, b, atol=1e-5).item() for a, b in zip(got_logprobs, want_logprobs, strict=True))
    assert set(routed) == {1, 2, 3}  # decode steps of 1, 2 and 3 rows went through the row starts


def holey_step(model: llama.Model) -> tuple[mx.array, list]:
    """Two rows' decode step after a pass whose last two tokens the first row refused (drafts:
    spec/holes.py leaves them in its buffer, masked out): its logits, and the caches."""
    from mlxd.engine.spec.holes import punch

    caches = [BatchKVCache([0, 3]) for _ in model.layers]
    model(mx.array([[3, 4, 5, 6, 7, 8], [0, 0, 0, 9, 10, 11]]), cache=caches)
    model(mx.array([[12, 13, 14], [15, 16, 17]]), cache=caches)
    punch(caches, [2, 0])
    return model(mx.array([[18], [19]]), cache=caches)[:, -1], caches


def test_a_batch_with_holes_takes_the_masked_kernel_with_its_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose rows refused drafts (HoleyKV) keeps the fused kernel, in its masked variant
    fed the step's mask: with MLX's attention standing in for it, the logits are mlx-lm's own;
    fed the row starts alone, they would not be (the holes would be seen)."""
    from mlxd.engine.spec.holes import HoleyKV

    monkeypatch.setattr(llama, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    model = random_llama(9, hidden=128, heads=4)  # head size 32: one the kernel takes
    want, _ = holey_step(model)

    asked: list[bool] = []
    fed: list[bool] = []
    use_keep = True

    def stand_in(q: mx.array, k: mx.array, v: mx.array, starts: mx.array, scale: float, warps: int = 0,
                 keep: mx.array | None = None) -> mx.array:
        fed.append(keep is not None)
        mask = mx.arange(k.shape[2])[None, None, None, :] >= starts[:, None, None, None]
        if keep is not None and use_keep:
            mask = mask & keep
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    monkeypatch.setattr(da, "fused", stand_in)
    monkeypatch.setattr(da, "check", lambda *_, masked=False: asked.append(masked) or True)
    assert da.install(model) == ["mlx_lm.models.llama"]
    got, caches = holey_step(model)
    assert type(caches[0]) is HoleyKV
    assert fed == [True] * len(model.layers) and asked == fed  # only the decode step is the kernel's
    assert mx.allclose(got, want, atol=1e-5).item()

    use_keep = False
    blind, _ = holey_step(model)
    assert not mx.allclose(blind, want, atol=1e-3).item()


def test_the_masked_kernels_check_leaves_out_holes_but_never_a_rows_last_key() -> None:
    keep = da.holey_mask(mx.array([0, 7, 44]), 45).reshape(3, 45).tolist()
    assert [row.index(True) for row in keep] == [0, 8, 44]  # each row from its start (7 is a hole)
    assert all(row[-1] for row in keep)
    assert [keep[0][p] for p in (0, 1, 3, 4, 21, 22, 26, 27, 28)] == [True, False, True, False, True, False, False,
                                                                       True, False]  # every third, and a run of five


def test_a_qwen_vlms_modules_from_mlx_lm_and_mlx_vlm_are_both_routed(vlms: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_lm.models import qwen2
    from mlx_vlm.models import base as vlm_base
    from mlx_vlm.models.qwen2_vl import language

    from mlxd.engine.models.loaded_model import LoadedModel

    monkeypatch.setattr(qwen2, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    monkeypatch.setattr(language, "scaled_dot_product_attention", vlm_base.scaled_dot_product_attention)
    view = LoadedModel(vlms["qwen2_vl"], "qwen").model  # its text twin is mlx-lm's qwen2 (models/vision.py)
    assert da.install(view) == ["mlx_lm.models.qwen2", "mlx_vlm.models.qwen2_vl.language"]
    assert language.scaled_dot_product_attention is not vlm_base.scaled_dot_product_attention
