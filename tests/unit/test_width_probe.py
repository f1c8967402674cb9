"""The width probe's widths, its memo's key and the memo itself (mlxd/engine/gpu/width_probe.py),
on the tiny random model."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from mlx_lm import load

from mlxd.engine.gpu import width_probe
from mlxd.protocol.sizing import AUTO_WIDTH_CAP


def test_the_widths_are_powers_of_two_up_to_the_cap_and_the_cap() -> None:
    assert width_probe.widths_up_to(1) == [1]
    assert width_probe.widths_up_to(8) == [1, 2, 4, 8]
    assert width_probe.widths_up_to(37) == [1, 2, 4, 8, 16, 32, 37]


def test_the_memo_key_follows_the_model_files_and_the_cap(tiny_model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "model"
    shutil.copytree(tiny_model, copy)
    key = width_probe.memo_key(copy, 32)
    assert width_probe.memo_key(copy, 32) == key  # the same engine started again
    assert width_probe.memo_key(copy, 16) != key  # less memory, another cap
    weights = next(copy.glob("*.safetensors"))
    os.utime(weights, (weights.stat().st_atime, weights.stat().st_mtime + 10))
    assert width_probe.memo_key(copy, 32) != key  # the weights were written again
    key = width_probe.memo_key(copy, 32, {"MLX_USE_CUDA_GRAPHS": "0", "MLX_PTX_CACHE_DIR": "/a"})
    assert width_probe.memo_key(copy, 32, {"MLX_USE_CUDA_GRAPHS": "1", "MLX_PTX_CACHE_DIR": "/a"}) != key  # MLX's settings
    assert width_probe.memo_key(copy, 32, {"MLX_USE_CUDA_GRAPHS": "0", "MLX_PTX_CACHE_DIR": "/b"}) == key  # not where kernels go


def test_a_measurement_is_kept_and_read_back_and_a_broken_memo_is_measured_again(tiny_model: Path,
                                                                                  tmp_path: Path) -> None:
    model = load(str(tiny_model))[0]
    vocab = int(model.args.vocab_size)
    rates, how = width_probe.remembered(tmp_path, model, vocab, tiny_model, 4)
    assert sorted(rates) == [1, 2, 4] and all(r > 0 for r in rates.values()) and how.startswith("probe ")
    again, how = width_probe.remembered(tmp_path, model, vocab, tiny_model, 4)
    assert again == rates and how.startswith("probe kept from ")
    [memo] = tmp_path.glob("*.json")
    memo.write_text("{not json")
    fresh, how = width_probe.remembered(tmp_path, model, vocab, tiny_model, 4)
    assert how.startswith("probe ") and "kept" not in how and sorted(fresh) == [1, 2, 4]
    assert width_probe.remembered(None, model, vocab, tiny_model, 2)[1].startswith("probe ")  # nowhere to keep it
    assert [p.name for p in tmp_path.iterdir()] == [memo.name]  # no temporary file left


def test_a_probe_that_fails_leaves_the_width_memory_allows(tiny_model: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    from mlxd.engine.gpu.loader import size_options
    from mlxd.engine.gpu.options import GatewayOptions
    from mlxd.engine.models.loaded_model import LoadedModel

    def broken(*args: object) -> None:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(width_probe, "remembered", broken)  # a GPU failing on cue, which the CPU cannot
    loaded = LoadedModel(tiny_model, "tiny")
    opts, sizing = size_options(loaded, GatewayOptions(batch=None, width_probe="on", prompt_cache_bytes=0))
    assert (opts.batch, sizing.width) == (AUTO_WIDTH_CAP["cpu"], AUTO_WIDTH_CAP["cpu"])
    assert "probe" not in sizing.why and "width probe failed (RuntimeError: out of memory)" in caplog.text
