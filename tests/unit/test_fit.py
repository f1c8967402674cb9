"""The fit check's arithmetic (protocol/fit.py), its inputs read from files (supervisor/library.py),
the measured rate the timeline keeps, and `mlxd models --fit`'s table."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from mlxd.cli.admin.tables import library_text
from mlxd.protocol.fit import TYPICAL_CONTEXT, assess
from mlxd.supervisor.http.timeline import RATE_MIN_TOKENS, Timeline
from mlxd.supervisor.library import Weights, quantization, weights_of

GB = 10**9


def test_a_model_that_fits_and_its_predicted_speed() -> None:
    booked = 4 * GB + 131072 * 8192 + GB  # weights, the KV its sizing books, a 1 GB prompt cache
    fit = assess(weights_bytes=4 * GB, embedding_bytes=GB // 2, tied=False, kv_per_token=131072, window=8192,
                 booked_bytes=booked, reserved_bytes=GB, budget_bytes=16 * GB, bandwidth_bytes_s=400 * GB)
    assert fit.fits and fit.kv_bytes == 131072 * 8192 and fit.total_bytes == booked and fit.reserved_bytes == GB
    assert fit.margin_bytes == 16 * GB - booked and fit.max_context == 8192
    # A step reads every weight but the untied embedding table, and the KV of TYPICAL_CONTEXT tokens.
    assert fit.bytes_per_token == 4 * GB - GB // 2 + 131072 * TYPICAL_CONTEXT
    assert fit.predicted_decode_tps == pytest.approx(400 * GB / fit.bytes_per_token, abs=0.05)
    tied = assess(weights_bytes=4 * GB, embedding_bytes=GB // 2, tied=True, kv_per_token=131072, window=8192,
                  booked_bytes=booked, reserved_bytes=GB, budget_bytes=16 * GB, bandwidth_bytes_s=400 * GB)
    assert tied.bytes_per_token == fit.bytes_per_token + GB // 2  # the head reads the table
    layered = assess(weights_bytes=4 * GB, embedding_bytes=GB // 2, tied=False, kv_per_token=131072, window=8192,
                     booked_bytes=booked, reserved_bytes=GB, budget_bytes=16 * GB, bandwidth_bytes_s=400 * GB,
                     layers=32, layer_overhead_s=1e-4)  # each layer's launches: 3.2 ms a step more
    assert layered.predicted_decode_tps == pytest.approx(1 / (fit.bytes_per_token / (400 * GB) + 32e-4), abs=0.05)


def test_a_model_that_does_not_fit_says_by_how_much_and_how_long_a_context_would() -> None:
    booked = 10 * GB + 8192 * 10**6 + GB // 2
    fit = assess(weights_bytes=10 * GB, embedding_bytes=0, tied=True, kv_per_token=10**6, window=8192,
                 booked_bytes=booked, reserved_bytes=GB // 2, budget_bytes=12 * GB, bandwidth_bytes_s=None)
    assert not fit.fits and fit.margin_bytes == 12 * GB - booked
    assert fit.max_context == (2 * GB - GB // 2) // 10**6  # the KV that fits beside the weights and the cache
    assert fit.predicted_decode_tps is None  # no bandwidth measured
    heavy = assess(weights_bytes=13 * GB, embedding_bytes=0, tied=True, kv_per_token=10**6, window=8192,
                   booked_bytes=14 * GB, reserved_bytes=0, budget_bytes=12 * GB, bandwidth_bytes_s=1e9)
    assert not heavy.fits and heavy.max_context == 0


def safetensors(path: Path, tensors: dict[str, tuple[str, int]]) -> None:
    """A header-only safetensors file: name -> (dtype, bytes)."""
    header, at = {}, 0
    for name, (dtype, size) in tensors.items():
        header[name] = {"dtype": dtype, "shape": [size], "data_offsets": [at, at + size]}
        at += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * at)


def test_the_embedding_table_and_the_head_are_read_from_the_headers(tmp_path: Path) -> None:
    safetensors(tmp_path / "model.safetensors", {"model.embed_tokens.weight": ("BF16", 1000),
                                                 "model.embed_tokens.scales": ("BF16", 40),
                                                 "model.layers.0.mlp.weight": ("BF16", 5000),
                                                 "lm_head.weight": ("BF16", 1000)})
    assert weights_of(tmp_path) == Weights(7040, 1040, True, "bf16")
    (tmp_path / "model.safetensors").unlink()
    safetensors(tmp_path / "model.safetensors", {"model.embed_tokens.weight": ("F32", 64), "x": ("F32", 8)})
    assert weights_of(tmp_path) == Weights(72, 64, False, "f32")
    assert quantization({"quantization": {"bits": 4, "group_size": 64}}, "u32") == "4-bit"
    assert quantization({"torch_dtype": "bfloat16"}, "bf16") == "bfloat16"
    assert quantization({}, "f32") == "float32"


def test_the_measured_rate_is_the_fastest_recent_answer() -> None:
    timeline = Timeline()
    assert timeline.decode_rate("m") is None
    timeline.record("m", 100.0, RATE_MIN_TOKENS - 1, 0.001, None, None)  # too short to say
    assert timeline.decode_rate("m") is None
    timeline.record("m", 101.0, 100, 2.0, None, None)  # 50 tok/s, a lone stream
    timeline.record("m", 102.0, 100, 4.0, None, None)  # 25 tok/s, beside others
    assert timeline.decode_rate("m") == 50.0


def test_models_fit_table() -> None:
    answer = {"machine": {"device": "cpu", "memory_bytes": 24 * GB, "budget_bytes": 18 * GB, "bandwidth_gbs": 12.5},
              "models": [{"id": "a", "size_bytes": GB, "quantization": "4-bit", "fit": {
                  "fits": False, "margin_bytes": -2 * GB, "max_context": 4096, "predicted_decode_tps": 41.2,
                  "measured_decode_tps": None}}, {"id": "b", "size_bytes": 10, "quantization": None, "fit": None}]}
    text = library_text(answer)
    assert "12.5 GB/s (measured)" in text and "short 2" in text and "41" in text
    lines = text.splitlines()
    assert lines[1].split()[:4] == ["NAME", "SIZE", "WEIGHTS", "FITS"] and lines[2].split()[0] == "a"
    unmeasured = library_text({"machine": {"device": "cpu", "bandwidth_gbs": None, "bandwidth_note": "being measured"},
                               "models": []})
    assert "not measured (being measured)" in unmeasured and "no models found" in unmeasured
