"""kv_quant.py: `--kv-bits` is checked once at load, against the model's head size and against
what the MLX backend can run, with a message that says what to do."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxd.engine.gpu.kv_quant import activation_dtype, check_quantized_kv

CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}  # heads of 64


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 64), (8, 32), (8, 64)])
def test_settings_the_backend_runs_pass(bits: int, group: int) -> None:
    check_quantized_kv(CONFIG, mx.bfloat16, bits, group)  # raises if it does not run here


def test_a_group_size_that_does_not_divide_the_head_is_refused_with_the_sizes() -> None:
    with pytest.raises(ValueError, match=r"64 values, not a multiple of --kv-group-size 128.*divides 64"):
        check_quantized_kv(CONFIG, mx.float16, 8, 128)


def test_a_backend_without_the_kernels_is_refused_with_its_own_words(monkeypatch: pytest.MonkeyPatch) -> None:
    # MLX's CUDA backend answers this way for some shapes; the CPU here has every kernel, so the
    # backend's refusal is made on cue
    def no_kernel(*_a: object, **_k: object) -> mx.array:
        raise RuntimeError("[quantized_matmul] No implementation for problem shape: 1x64x128x32")

    monkeypatch.setattr(mx, "quantized_matmul", no_kernel)
    with pytest.raises(ValueError) as err:
        check_quantized_kv(CONFIG, mx.bfloat16, 8, 64)
    text = str(err.value)
    assert "--kv-bits 8 --kv-group-size 64" in text
    assert "No implementation for problem shape" in text
    assert "start without --kv-bits" in text


def test_the_activation_dtype_is_the_models_first_float_parameter() -> None:
    layer = nn.Linear(64, 64)
    layer.set_dtype(mx.bfloat16)
    assert activation_dtype(layer) == mx.bfloat16
    quantized = nn.QuantizedLinear.from_linear(nn.Linear(64, 64), group_size=32, bits=4)
    quantized.set_dtype(mx.float16)
    assert activation_dtype(quantized) == mx.float16  # the scales carry it; the weights are uint32
