"""Flattened batched decode rows through quantized layers give the same numbers (CPU here)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxd.engine.gpu.flat_rows import (
    FLATTEN_MIN_ROWS,
    RowFlatQuantizedLinear,
    flatten_quantized_rows,
)


def quantized_model() -> nn.Module:
    mx.random.seed(3)
    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 64))
    nn.quantize(model, group_size=64, bits=4)
    return model


def test_every_quantized_layer_switches_class_and_keeps_its_weights() -> None:
    model = quantized_model()
    before = [mx.array(layer.weight) for layer in model.layers]
    assert flatten_quantized_rows(model) == 2
    assert all(type(layer) is RowFlatQuantizedLinear for layer in model.layers)
    assert all(mx.array_equal(a, layer.weight) for a, layer in zip(before, model.layers, strict=True))


def test_batched_decode_rows_give_the_same_output_flattened() -> None:
    model = quantized_model()
    for rows in (1, FLATTEN_MIN_ROWS - 1, FLATTEN_MIN_ROWS, 16):
        x = mx.random.normal((rows, 1, 128))
        expected = model(x)
        flat = quantized_model()
        flatten_quantized_rows(flat)
        got = flat(x)
        assert got.shape == expected.shape == (rows, 1, 64)
        assert mx.allclose(got, expected, atol=1e-4).item()


def test_prefill_shapes_are_left_alone() -> None:
    model = quantized_model()
    flatten_quantized_rows(model)
    x = mx.random.normal((FLATTEN_MIN_ROWS, 5, 128))
    assert model(x).shape == (FLATTEN_MIN_ROWS, 5, 64)
