"""The batch width from a registry entry to the engine: its argv, its memory estimate, its admin row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxd.engine.settings import EngineSettings, parse_args
from mlxd.protocol.sizing import AUTO_WIDTH_CAP, kv_memory_tokens, size_engine
from mlxd.supervisor.config import DEFAULT_GATHER_MS, PoolConfig, decode_config
from mlxd.supervisor.engines.engine import Engine
from mlxd.supervisor.engines.footprint import estimate_bytes, this_device
from mlxd.supervisor.engines.pool import Pool, engine_args_from, engine_env_from
from mlxd.supervisor.http import admin_routes
from mlxd.supervisor.registry import ModelEntry

# 2 layers x 2 KV heads x dim 4, float16: 64 bytes a token; an 8k window.
SMALL = {"num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 4, "max_position_embeddings": 8192}


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_argv_names_the_batch_width(tmp_path: Path) -> None:
    argv = Engine("m", Path("/models/m"), tmp_path, batch=12).argv()
    assert flag(argv, "--batch") == "12"
    assert flag(argv, "--model") == "/models/m" and flag(argv, "--model-id") == "m"
    assert flag(argv, "--max-context") is None
    assert flag(Engine("m", Path("/m"), tmp_path, 2048).argv(), "--max-context") == "2048"
    assert flag(Engine("m", Path("/m"), tmp_path).argv(), "--batch") == "1"  # the engine's own default
    auto = Engine("m", Path("/m"), tmp_path, batch=None, memory_bytes=5 * 1024**3).argv()
    assert (flag(auto, "--batch"), flag(auto, "--memory-bytes")) == ("auto", str(5 * 1024**3))
    settings = parse_args(["--model", "m", "--model-id", "m", "--socket", "s", "--batch", "auto",
                           "--memory-bytes", "1000"])
    assert (settings.batch, settings.memory_bytes) == (None, 1000)
    assert parse_args(["--model", "m", "--model-id", "m", "--socket", "s", "--batch", "7"]).batch == 7


@pytest.mark.parametrize("bad", ["0", "-3", "eight", ""])
def test_the_engine_refuses_a_bad_batch(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--model", "m", "--model-id", "m", "--socket", "s", "--batch", bad])
    assert exited.value.code == 2 and "--batch" in capsys.readouterr().err


def test_the_pool_gives_the_entry_s_width_to_its_engine_and_estimate(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMALL))
    pool = Pool(tmp_path, config=PoolConfig(batch=3, prompt_cache_bytes=7000, memory_budget_gb=1))
    slot = pool.slot_for(ModelEntry(id="m", path=model, source="config", size_bytes=100, batch=5))
    argv = slot.engine.argv()
    assert (flag(argv, "--batch"), flag(argv, "--memory-bytes")) == ("5", str(1024**3))  # sized within the budget
    # weights, the KV of 5 rows, and the prompt cache's RAM tier
    assert slot.memory_bytes == estimate_bytes(model, 100, None, 5) + 7000 == 100 + 5 * 4096 * 64 + 7000
    row = admin_routes.engine_info(pool, slot, None)
    assert (row.batch, row.width, row.sizing) == (5, None, None)  # the documented EngineRow; no width until it serves


def test_auto_is_the_default_and_the_pool_books_what_the_engine_will_choose(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMALL))
    assert PoolConfig().batch == "auto" and ModelEntry(id="m", path=model, source="config", size_bytes=1).batch == "auto"
    pool = Pool(tmp_path, config=PoolConfig(prompt_cache_bytes=7000, memory_budget_gb=1))
    slot = pool.slot_for(ModelEntry(id="m", path=model, source="config", size_bytes=100))
    assert flag(slot.engine.argv(), "--batch") == "auto"
    sizing = size_engine(width=None, context=8192, device=this_device(),
                         memory_tokens=kv_memory_tokens(1024**3, 100, 7000, 64))
    assert sizing.width == AUTO_WIDTH_CAP[this_device()]  # a tiny model: the device's widest
    assert slot.memory_bytes == 100 + sizing.kv_budget_tokens * 64 + 7000
    assert admin_routes.engine_info(pool, slot, None).batch == "auto"


def test_pool_cuda_graphs_is_an_mlx_setting_in_the_engines_environment() -> None:
    assert engine_env_from(PoolConfig()) == ()  # the engine's own default (mlx_env.py: off) holds
    assert engine_env_from(PoolConfig(cuda_graphs=True)) == (("MLX_USE_CUDA_GRAPHS", "1"),)
    assert engine_args_from(PoolConfig(cuda_graphs=True)) == ()  # not a flag: MLX reads it at its first use
    assert decode_config(b"[pool]\ncuda_graphs = true\n", Path("c.toml")).pool.cuda_graphs is True


def test_pool_keys_reach_the_engine_only_when_they_differ_from_its_defaults(tmp_path: Path) -> None:
    assert engine_args_from(PoolConfig()) == ()  # the engine's own defaults: nothing to pass
    assert EngineSettings.__dataclass_fields__["gather_ms"].default == DEFAULT_GATHER_MS
    assert engine_args_from(PoolConfig(warmup="off", gather_ms=0)) == ("--warmup", "off", "--gather-ms", "0")
    assert engine_args_from(PoolConfig(warmup="on", gather_ms=2.5)) == ("--warmup", "on", "--gather-ms", "2.5")
    pool = Pool(tmp_path, config=PoolConfig(warmup="off", gather_ms=12))
    slot = pool.slot_for(ModelEntry(id="m", path=tmp_path, source="config", size_bytes=100, batch=2))
    argv = slot.engine.argv()
    assert (flag(argv, "--warmup"), flag(argv, "--gather-ms"), flag(argv, "--batch")) == ("off", "12", "2")


def test_prompt_cache_keys_and_the_data_dir_reach_the_engine(tmp_path: Path) -> None:
    config = PoolConfig(prompt_cache_bytes=0, ssd_cache_bytes=10**9, kv_bits=4, kv_group_size=32,
                        ssd_write_behind=False)
    args = engine_args_from(config, tmp_path / "kv")
    assert args == ("--prompt-cache-bytes", "0", "--ssd-cache-bytes", "1000000000", "--kv-bits", "4",
                    "--kv-group-size", "32", "--ssd-write-behind", "off", "--ssd-cache-dir", str(tmp_path / "kv"))
    settings = parse_args(["--model", "m", "--model-id", "m", "--socket", "s", *args])  # the engine takes them
    assert (settings.prompt_cache_bytes, settings.ssd_cache_bytes, settings.kv_bits, settings.kv_group_size,
            settings.ssd_cache_dir, settings.write_behind) == (0, 10**9, 4, 32, tmp_path / "kv", False)
    assert parse_args(["--model", "m", "--model-id", "m", "--socket", "s"]).write_behind is True
    pool = Pool(tmp_path, config=PoolConfig(), kv_dir=tmp_path / "kv")
    slot = pool.slot_for(ModelEntry(id="m", path=tmp_path, source="config", size_bytes=100, batch=2))
    assert flag(slot.engine.argv(), "--ssd-cache-dir") == str(tmp_path / "kv")
