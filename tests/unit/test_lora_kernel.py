"""Where the one-launch LoRA kernel (mlxd/engine/models/lora_kernel.py) is used: decode steps of
small-rank adapters on CUDA only. Its arithmetic is checked against the MLX ops it
replaces on an NVIDIA GPU by benchmarks/lora_kernel_check.py (no CUDA here)."""

from __future__ import annotations

from pathlib import Path

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
    ((8, 1, 64), (64, 8), True),  # one stack for all rows: every row in its only slot
    ((8, 1, 64), (64, 32), False),
])
def test_it_takes_decode_steps_of_small_ranks(x_shape: tuple[int, ...], a_shape: tuple[int, ...], takes: bool) -> None:
    assert lora_kernel.fits(mx.zeros(x_shape), mx.zeros(a_shape)) is takes


def test_the_grouped_path_gives_the_mlx_ops_answer(tiny_model: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's side of the kernel (adapter_bank.fused_update), with the CUDA launch stood in
    for by the same arithmetic in MLX ops: one launch a group (q, k, v; gate, up; then o and down
    alone), each sibling's output handed over when it is called with the group's input, and
    the logits those of the MLX ops path."""
    from mlx_lm.utils import load_model

    from mlxd.engine.models.adapter_bank import AdapterBank
    from mlxd.engine.models.random_adapter import build_random_adapter

    launches: list[int] = []

    def stand_in(x: mx.array, slots: mx.array, layers: list[tuple[mx.array, mx.array, mx.array]]) -> list[mx.array]:
        launches.append(len(layers))
        slotted = [(y, a[None] if a.ndim == 2 else a, b[None] if b.ndim == 2 else b) for y, a, b in layers]
        return [y + mx.gather_mm(mx.gather_mm(x, a, rhs_indices=slots), b, rhs_indices=slots) for y, a, b in slotted]

    monkeypatch.setattr(lora_kernel, "usable", lambda: True)
    monkeypatch.setattr(lora_kernel, "rows_update_group", stand_in)
    model, _ = load_model(tiny_model)
    bank = AdapterBank(model)
    for i in range(2):  # every linear layer: the groups are whole
        bank.mount(f"a{i}", build_random_adapter(tiny_model, tmp_path / f"a{i}", rank=4, seed=i, strength=0.1, keys=None))
    stacks = [bank.resolve(s) for s in ("a0", "none", "a1", "a0+a1")]
    tokens = mx.array([[5], [7], [9], [11]])
    logits = {}
    for fused in (False, True):
        bank.fused = fused
        with bank.rows(stacks):
            logits[fused] = model(tokens)
        mx.eval(logits[fused])
    layers = len(model.model.layers)
    assert sorted(launches) == [1] * (2 * layers) + [2] * layers + [3] * layers  # o, down; gate+up; q+k+v
    assert mx.allclose(logits[True], logits[False], atol=1e-5).item()
    assert not mx.allclose(logits[True][0], model(tokens)[0], atol=1e-3).item()  # the adapters move row 0 off the base
    assert mx.allclose(logits[True][1], model(tokens)[1], atol=1e-5).item()  # and row 1, under none, stays
    # Every row under one stack (a lone stream before its merged copy): the same launches, each
    # row in slot 0 of that stack's weights.
    launches.clear()
    one = {}
    for fused in (False, True):
        bank.fused = fused
        with bank.one(stacks[3]):
            one[fused] = model(tokens)
        mx.eval(one[fused])
    assert sorted(launches) == [1] * (2 * layers) + [2] * layers + [3] * layers
    assert mx.allclose(one[True], one[False], atol=1e-5).item()
    assert mx.allclose(one[True][3], logits[False][3], atol=1e-5).item()  # row 3 was under a0+a1 before too
