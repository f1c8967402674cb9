"""Long chunks through quantized layers dequantized (dense_prefill.py): the layer's own numbers,
decode shapes left to the quantized kernel (CPU here)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxd.engine.gpu import dense_prefill, first_pass
from mlxd.engine.gpu.dense_prefill import (
    CPU_MIN_TOKENS as DENSE_MIN_TOKENS,  # the tests run on the CPU
)
from mlxd.engine.gpu.flat_rows import RowFlatQuantizedLinear, flatten_quantized_rows


def quantized_model(bias: bool = True) -> nn.Module:
    mx.random.seed(3)
    model = nn.Sequential(nn.Linear(128, 256, bias=bias), nn.Linear(256, 64, bias=bias))
    nn.quantize(model, group_size=64, bits=4)
    return model


@pytest.mark.parametrize("bias", [True, False])
def test_a_long_chunk_gives_the_quantized_layers_numbers(bias: bool) -> None:
    x = mx.random.normal((2, DENSE_MIN_TOKENS + 5, 128), key=mx.random.key(1))
    expected = quantized_model(bias)(x)
    model = quantized_model(bias)
    assert dense_prefill.install(model) == 2
    calls = count_quantized_matmuls(model, x)
    assert calls == 0  # every layer went the dense way
    got = model(x)
    assert got.shape == expected.shape == (2, DENSE_MIN_TOKENS + 5, 64)
    assert mx.allclose(got, expected, atol=1e-3).item()


@pytest.mark.parametrize("shape", [(1, 1, 128), (16, 1, 128), (1, DENSE_MIN_TOKENS - 1, 128), (128,)])
def test_decode_steps_and_short_chunks_stay_on_the_quantized_kernel(shape: tuple[int, ...]) -> None:
    model = quantized_model()
    flatten_quantized_rows(model)  # the engine's order: flattened decode rows first
    dense_prefill.install(model)
    assert all(isinstance(layer, RowFlatQuantizedLinear) for layer in model.layers)
    x = mx.random.normal(shape, key=mx.random.key(2))
    assert count_quantized_matmuls(model, x) == 2
    assert mx.allclose(model(x), quantized_model()(x), atol=1e-4).item()


def test_installing_twice_changes_nothing_more_and_the_weights_stay() -> None:
    model = quantized_model()
    before = [mx.array(layer.weight) for layer in model.layers]
    assert dense_prefill.install(model) == 2
    classes = [type(layer) for layer in model.layers]
    assert dense_prefill.install(model) == 0
    assert [type(layer) for layer in model.layers] == classes
    assert all(mx.array_equal(a, layer.weight) for a, layer in zip(before, model.layers, strict=True))


def test_a_model_without_quantized_layers_is_left_alone() -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    assert dense_prefill.install(model) == 0
    assert type(model.layers[0]) is nn.Linear


def test_a_layer_the_dense_way_gets_wrong_is_not_switched(monkeypatch: pytest.MonkeyPatch) -> None:
    model = quantized_model()
    monkeypatch.setattr(dense_prefill, "dense", lambda layer, x: nn.QuantizedLinear.__call__(layer, x) + 1.0)
    assert dense_prefill.install(model) == 0
    assert all(type(layer) is nn.QuantizedLinear for layer in model.layers)


def test_the_last_row_projection_wraps_the_dense_class() -> None:
    """first_pass.py's class goes on top of this one (the engine installs it last): a first pass
    projects its last row alone, which the quantized kernel then serves."""
    model = quantized_model()
    dense_prefill.install(model)
    head = model.layers[1]
    head.__class__ = first_pass._last_row_class(type(head), "__call__")
    x = mx.random.normal((1, DENSE_MIN_TOKENS + 3, 128), key=mx.random.key(4))
    whole = model(x)
    with first_pass.last_row_only():
        last = model(x)
    assert last.shape == (1, 1, 64)
    assert mx.allclose(last[0, -1], whole[0, -1], atol=1e-3).item()


def count_quantized_matmuls(model: nn.Module, x: mx.array) -> int:
    """How many times `model(x)` calls mx.quantized_matmul."""
    calls = 0
    real = mx.quantized_matmul

    def counting(*args: object, **kwargs: object) -> mx.array:
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)  # type: ignore[arg-type]

    mx.quantized_matmul = counting
    try:
        mx.eval(model(x))
    finally:
        mx.quantized_matmul = real
    return calls
