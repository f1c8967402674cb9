"""Adapters served per row (mlxd/engine/models/adapter_bank.py, adapters.py) against mlx-lm's own
LoRA and DoRA layers, on the tiny random llama in float32 (and 8-bit quantized)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_unflatten
from mlx_lm.tuner.utils import load_adapters
from mlx_lm.utils import load_model

from mlxd.engine.models.adapter_bank import MERGE_AFTER_PASSES, AdapterBank, namespace
from mlxd.engine.models.adapters import AdapterError
from mlxd.engine.models.random_adapter import build_random_adapter

TOKENS = mx.array([[1, 5, 7, 9, 11, 2], [3, 4, 5, 6, 7, 8], [9, 9, 9, 1, 2, 3], [4, 4, 4, 4, 4, 4]])


@pytest.fixture(scope="module")
def made(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bank-adapters")
    return {
        "a": build_random_adapter(tiny_model, root / "a", rank=4, seed=1, strength=0.1),
        "b": build_random_adapter(tiny_model, root / "b", rank=8, seed=2, keys=("self_attn.q_proj", "mlp.up_proj"),
                                  strength=0.1),
        "d": build_random_adapter(tiny_model, root / "d", rank=4, seed=3, dora=True, strength=0.1),
    }


def mlx_lm(tiny_model: Path, *paths: Path, quantize: bool = False, fuse: bool = False) -> nn.Module:
    """The model with mlx-lm's layers for `paths` (all but the last fused in, and with `fuse` the
    last too)."""
    model, _ = load_model(tiny_model)
    if quantize:
        nn.quantize(model, group_size=32, bits=8)
    for i, path in enumerate(paths):
        load_adapters(model, str(path))
        if i < len(paths) - 1 or fuse:
            model.update_modules(tree_unflatten([(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]))
    return model


def ours(tiny_model: Path, made: dict[str, Path], quantize: bool = False) -> tuple[Any, AdapterBank, dict[str, Any]]:
    model, _ = load_model(tiny_model)
    if quantize:
        nn.quantize(model, group_size=32, bits=8)
    bank = AdapterBank(model)
    return model, bank, {name: bank.mount(name, path) for name, path in made.items()}


def close(a: mx.array, b: mx.array, atol: float = 2e-5) -> bool:
    return bool(mx.allclose(a, b, atol=atol, rtol=1e-4))


@pytest.mark.parametrize("quantize", [False, True], ids=["float32", "8-bit"])
def test_each_row_gets_its_own_adapters_update_as_mlx_lm_computes_it(
    tiny_model: Path, made: dict[str, Path], quantize: bool
) -> None:
    model, bank, a = ours(tiny_model, made, quantize)
    base = model(TOKENS)
    with bank.rows([(a["a"],), (), (a["d"],), (a["a"], a["b"])]):
        mixed = model(TOKENS)
    assert bank.mixed_passes == 1 and bank.plan is None  # the plan lasts the pass only
    expected = [mlx_lm(tiny_model, made["a"], quantize=quantize)(TOKENS)[0], base[1],
                mlx_lm(tiny_model, made["d"], quantize=quantize)(TOKENS)[2],
                mlx_lm(tiny_model, made["a"], made["b"], quantize=quantize)(TOKENS)[3]]
    for row, want in enumerate(expected):
        if quantize and row == 3:
            continue  # mlx-lm cannot stack adapters: its row 3 has `a` fused in, which it quantizes again
        assert close(mixed[row], want), row
        assert not close(mixed[row], base[row]) or row == 1
    with bank.one((a["b"],)):
        alone = model(TOKENS)
    assert close(alone, mlx_lm(tiny_model, made["b"], quantize=quantize)(TOKENS))
    assert close(model(TOKENS), base)  # outside a plan: the base model


@pytest.mark.parametrize("quantize", [False, True], ids=["float32", "8-bit"])
def test_a_stack_that_keeps_every_row_runs_merged_as_mlx_lm_fuses_it(
    tiny_model: Path, made: dict[str, Path], quantize: bool
) -> None:
    model, bank, a = ours(tiny_model, made, quantize)
    bank.merge = True
    for name in ("a", "d"):
        unfused = []
        for _ in range(MERGE_AFTER_PASSES + 1):
            with bank.one((a[name],)):
                unfused.append(model(TOKENS))
        assert bank.merged_bytes > 0
        assert bank.plan is None
        fused = mlx_lm(tiny_model, made[name], quantize=quantize, fuse=True)(TOKENS)
        assert close(unfused[-1], fused, atol=1e-6 if not quantize else 1e-5), name
        # Merged as unmerged, to rounding; a quantized layer's merged weight is quantized again
        # (as mlx-lm's fuse does), which rounds it once more.
        drift = (mx.abs(unfused[0] - unfused[-1]).max() / mx.abs(unfused[0]).max()).item()
        assert drift < (0.05 if quantize else 1e-5), drift
    with bank.rows([(a["a"],), ()]):  # mixed rows run unmerged
        mixed = model(TOKENS[:2])
    assert close(mixed[1], model(TOKENS[:2])[1])
    assert bank.unmount("d") and bank.merged_bytes == 0


def test_a_stack_below_the_streak_runs_unmerged(tiny_model: Path, made: dict[str, Path]) -> None:
    model, bank, a = ours(tiny_model, made)
    bank.merge = True
    for i in range(MERGE_AFTER_PASSES - 1):
        with bank.one((a["a"] if i % 2 else a["b"],)):
            model(TOKENS)
    assert bank.merged_bytes == 0


def test_resolving_a_requests_adapter_field(tiny_model: Path, made: dict[str, Path]) -> None:
    _, bank, a = ours(tiny_model, made)
    assert bank.resolve(None) == () and bank.resolve("none") == () and bank.resolve(" ") == ()
    assert bank.resolve("b+a") == bank.resolve("a + b") == (a["a"], a["b"])
    with pytest.raises(ValueError, match="'zz' is not loaded"):
        bank.resolve("a+zz")
    with pytest.raises(ValueError, match="DoRA"):
        bank.resolve("d+a")


def test_the_prompt_cache_key_of_a_first_token_differs_by_token_and_stack(tiny_model: Path, made: dict[str, Path]) -> None:
    _, _, a = ours(tiny_model, made)
    keys = {namespace((a["a"],), 1), namespace((a["a"],), 2), namespace((a["b"],), 1), namespace((a["a"], a["b"]), 1)}
    assert len(keys) == 4 and all(k < 0 for k in keys)
    assert namespace((a["a"], a["b"]), 1) == namespace((a["b"], a["a"]), 1)


def test_adapters_that_do_not_fit_are_refused_naming_why(
    tiny_model: Path, smollm2: Path, made: dict[str, Path], tmp_path: Path
) -> None:
    _, bank, _ = ours(tiny_model, made)
    other = build_random_adapter(smollm2, tmp_path / "smol", rank=2, num_layers=1)
    with pytest.raises(AdapterError, match=r"no module|do not fit"):
        bank.mount("smol", other)
    with pytest.raises(AdapterError, match="not an adapter dir"):
        bank.mount("x", tmp_path / "nowhere")
    full = tmp_path / "full"
    full.mkdir()
    (full / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "full"}))
    with pytest.raises(AdapterError, match="full fine-tune"):
        bank.mount("full", full)
    alpha = tmp_path / "alpha"
    alpha.mkdir()
    (alpha / "adapter_config.json").write_text(json.dumps({"lora_parameters": {"rank": 8, "alpha": 16}}))
    with pytest.raises(AdapterError, match="scale"):
        bank.mount("alpha", alpha)
    with pytest.raises(AdapterError, match="cannot name"):
        bank.mount("a+b", made["a"])
    assert set(bank.mounted) == {"a", "b", "d"}
    vlm = AdapterBank(nn.Linear(2, 2), refusal="adapters are served on text models only")
    with pytest.raises(AdapterError, match="text models only"):
        vlm.mount("a", made["a"])
