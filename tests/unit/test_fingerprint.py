"""fingerprint.py: the SSD tier's dir name covers the model's config, its weights (sampled), its
tokenizer, the KV settings and the MLX / mlx-lm versions; the dir is made private with a note."""

from __future__ import annotations

import json
import random
import stat
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from mlxd.engine.cache import fingerprint as fp

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "vocab_size": 512, "rope_theta": 10000.0}


def safetensors_bytes(data_size: int, seed: int = 0) -> bytes:
    """A plausible safetensors file: 8-byte length, a JSON header, `data_size` random bytes."""
    header = json.dumps({"__metadata__": {"format": "mlx"},
                         "w": {"dtype": "U8", "shape": [data_size], "data_offsets": [0, data_size]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + random.Random(seed).randbytes(data_size)


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (path / "model.safetensors").write_bytes(safetensors_bytes(4096))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}}))
    return path


def fingerprint_of(model_dir: Path, kv_bits: int | None = None, kv_group_size: int = 64) -> str:
    return fp.fingerprint(fp.describe(model_dir, kv_bits, kv_group_size))


def change_byte(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(raw)


def test_the_fingerprint_is_stable_and_short_hex(model_dir: Path) -> None:
    first = fingerprint_of(model_dir)
    assert fingerprint_of(model_dir) == first
    assert len(first) == 24 and int(first, 16) >= 0
    assert fp.describe(model_dir, None, 64) == fp.describe(model_dir, None, 64)


def test_a_config_change_changes_it_but_reformatting_does_not(model_dir: Path) -> None:
    before = fingerprint_of(model_dir)
    (model_dir / "config.json").write_text(json.dumps(dict(reversed(list(CONFIG.items())))))
    assert fingerprint_of(model_dir) == before  # the same config, other key order and spacing
    (model_dir / "config.json").write_text(json.dumps({**CONFIG, "rope_theta": 500000.0}))
    assert fingerprint_of(model_dir) != before


@pytest.mark.parametrize("where", ["header", "data"])
def test_a_one_byte_change_in_a_small_weights_file_changes_it(model_dir: Path, where: str) -> None:
    weights = model_dir / "model.safetensors"
    before = fingerprint_of(model_dir)
    (n,) = struct.unpack("<Q", weights.read_bytes()[:8])
    change_byte(weights, 8 + n // 2 if where == "header" else 8 + n + 100)
    assert fingerprint_of(model_dir) != before


def test_weights_are_sampled_at_sixteen_offsets_in_a_large_file(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    size = fp.SAMPLES * 2 * fp.SAMPLE_BYTES  # samples cover every other 64 KiB
    head = len(safetensors_bytes(size)) - size  # the length field and JSON (same digit count)
    weights.write_bytes(safetensors_bytes(size - head))
    assert weights.stat().st_size == size
    (n,) = struct.unpack("<Q", weights.read_bytes()[:8])
    assert 8 + n < 1000

    def changes_it(offset: int) -> bool:
        before = fingerprint_of(model_dir)
        change_byte(weights, offset)
        after = fingerprint_of(model_dir)
        change_byte(weights, offset)  # put it back
        assert fingerprint_of(model_dir) == before
        return after != before

    stride = size // fp.SAMPLES
    assert changes_it(1000)  # in the region at offset 0, past the header
    assert changes_it(7 * stride + 5)
    assert changes_it(15 * stride + fp.SAMPLE_BYTES - 1)  # the last byte of the last sample
    # as documented: a byte outside every sample and the header does not count
    assert not changes_it(stride - 1)
    assert not changes_it(3 * stride + fp.SAMPLE_BYTES + 10)


def test_a_large_weights_header_counts_past_the_first_sample(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    size = fp.SAMPLES * 2 * fp.SAMPLE_BYTES
    stride = size // fp.SAMPLES
    names = {f"model.layers.{i}.weight": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]}
             for i in range(1200)}  # a real checkpoint's header runs to hundreds of KB
    header = json.dumps(names).encode()
    header += b" " * (-len(header) % 8)
    assert fp.SAMPLE_BYTES < 8 + len(header) < stride
    raw = struct.pack("<Q", len(header)) + header
    weights.write_bytes(raw + random.Random(0).randbytes(size - len(raw)))
    before = fingerprint_of(model_dir)
    change_byte(weights, (fp.SAMPLE_BYTES + 8 + len(header)) // 2)  # in the header, outside every sample
    assert fingerprint_of(model_dir) != before


def test_weights_file_size_name_and_count_change_it(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    base = fingerprint_of(model_dir)
    with open(weights, "ab") as f:
        f.write(b"\0")
    grown = fingerprint_of(model_dir)
    assert grown != base
    weights.rename(model_dir / "model-00001-of-00001.safetensors")
    renamed = fingerprint_of(model_dir)
    assert renamed != grown
    (model_dir / "model-00002-of-00002.safetensors").write_bytes(safetensors_bytes(64, seed=1))
    assert fingerprint_of(model_dir) not in {base, grown, renamed}


def test_a_weights_file_shorter_than_its_length_field_is_still_fingerprinted(model_dir: Path) -> None:
    (model_dir / "model.safetensors").write_bytes(b"\x01\x02\x03")
    short = fingerprint_of(model_dir)
    (model_dir / "model.safetensors").write_bytes(b"\x01\x02\x04")
    assert fingerprint_of(model_dir) != short


def test_a_tokenizer_change_changes_it(model_dir: Path) -> None:
    before = fingerprint_of(model_dir)
    (model_dir / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 1, "b": 0}}}))
    changed = fingerprint_of(model_dir)
    assert changed != before
    (model_dir / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    with_config = fingerprint_of(model_dir)
    assert with_config != changed
    (model_dir / "chat_template.jinja").write_text("{{ messages }}")
    assert fingerprint_of(model_dir) != with_config


def test_files_outside_the_model_config_weights_and_tokenizer_do_not_count(model_dir: Path) -> None:
    before = fingerprint_of(model_dir)
    (model_dir / "README.md").write_text("# a model\n")
    (model_dir / "generation_config.json").write_text('{"temperature": 0.7}')
    (model_dir / "model.safetensors.index.json").write_text("{}")
    assert fingerprint_of(model_dir) == before


def test_kv_settings_change_it(model_dir: Path) -> None:
    plain = fingerprint_of(model_dir, None, 64)
    four = fingerprint_of(model_dir, 4, 64)
    eight = fingerprint_of(model_dir, 8, 64)
    four_32 = fingerprint_of(model_dir, 4, 32)
    assert len({plain, four, eight, four_32}) == 4


def test_the_group_size_does_not_count_without_kv_bits(model_dir: Path) -> None:
    assert fingerprint_of(model_dir, None, 32) == fingerprint_of(model_dir, None, 64)
    assert fp.describe(model_dir, None, 32)["kv"] == {"bits": None, "group_size": None}
    assert fp.describe(model_dir, 4, 32)["kv"] == {"bits": 4, "group_size": 32}


@pytest.mark.parametrize("dist", ["mlx", "mlx-lm"])
def test_mlx_and_mlx_lm_versions_change_it(model_dir: Path, monkeypatch: pytest.MonkeyPatch, dist: str) -> None:
    real: Callable[[str], str | None] = fp._version
    before = fingerprint_of(model_dir)
    monkeypatch.setattr(fp, "_version", lambda d: "999.0" if d == dist else real(d))
    assert fingerprint_of(model_dir) != before


def test_a_missing_distribution_has_no_version() -> None:
    assert fp._version("no-such-distribution-mlxd-test") is None
    assert fp._version("numpy") is not None


def test_tier_dir_makes_a_private_dir_with_its_fingerprint_note(tmp_path: Path, model_dir: Path) -> None:
    root = tmp_path / "data" / "kv"
    path = fp.tier_dir(root, model_dir, 4, 32)

    assert path == root / fingerprint_of(model_dir, 4, 32)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    note = json.loads((path / "fingerprint.json").read_text())
    desc = fp.describe(model_dir, 4, 32)
    assert note["kv"] == {"bits": 4, "group_size": 32}
    assert note["weights"] == desc["weights"] and note["tokenizer"] == desc["tokenizer"]
    assert note["config"] == {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}
    assert (note["mlx"], note["mlx_lm"], note["format"]) == (desc["mlx"], desc["mlx_lm"], fp.FORMAT)
    assert sorted(p.name for p in path.iterdir()) == ["fingerprint.json"]  # no temp file left


def test_tier_dir_is_the_same_dir_next_time_and_keeps_its_note(tmp_path: Path, model_dir: Path) -> None:
    first = fp.tier_dir(tmp_path, model_dir, None, 64)
    note = first / "fingerprint.json"
    note.write_text("kept\n")
    assert fp.tier_dir(tmp_path, model_dir, None, 64) == first
    assert note.read_text() == "kept\n"


def test_other_settings_get_other_dirs_under_the_same_root(tmp_path: Path, model_dir: Path) -> None:
    root = tmp_path / "kv"
    dirs = {fp.tier_dir(root, model_dir, bits, 64) for bits in (None, 4, 8)}
    assert len(dirs) == 3
    assert sorted(p.name for p in root.iterdir()) == sorted(d.name for d in dirs)
    for d in dirs:
        assert (d / "fingerprint.json").is_file()
