"""Where the one-launch LoRA kernel (mlxd/engine/models/lora_kernel.py) is used: decode steps of
small-rank stacked adapters on CUDA only. Its arithmetic is checked against the MLX ops it
replaces on an NVIDIA GPU by benchmarks/lora_kernel_check.py (no CUDA here)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxd.engine.models import lora_kernel


def test_it_is_never_used_off_cuda() -> None:
    assert not mx.cuda.is_available()
    assert lora_kernel.usable() is False


@pytest.mark.parametrize(("x_shape", "a_shape", "takes"), [
    ((8, 1, 64), (3, 64, 8), True),  # a decode step, rank 8
    ((8, 1, 64), (3, 64, 16), True),
    ((8, 1, 64), (3, 64, 32), False),  # a rank above MAX_RANK: the MLX ops are faster there
    ((8, 5, 64), (3, 64, 8), False),  # a prefill chunk: matmuls
    ((8, 64), (3, 64, 8), False),
    ((8, 1, 64), (64, 8), False),  # one stack for all rows: not a per-row update
])
def test_it_takes_decode_steps_of_small_ranks(x_shape: tuple[int, ...], a_shape: tuple[int, ...], takes: bool) -> None:
    assert lora_kernel.fits(mx.zeros(x_shape), mx.zeros(a_shape)) is takes
