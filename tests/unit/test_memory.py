"""A token's KV (protocol/memory.py), the rows' budget (protocol/sizing.py) and the pool's estimate built on them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from mlxd.protocol.memory import ROW_TOKENS, kv_bytes_per_token, text_config
from mlxd.protocol.sizing import AUTO_WIDTH_CAP, GIB, kv_memory_tokens, size_engine, wanted_tokens
from mlxd.supervisor.engines import footprint
from mlxd.supervisor.engines.footprint import estimate_bytes
from tests.support import fake_weights

# Qwen2.5-7B's shape: 28 layers, 4 KV heads of dim 128 (3584 / 28), bfloat16: 56 KiB a token.
QWEN_7B = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
           "torch_dtype": "bfloat16", "max_position_embeddings": 32768}
PER_TOKEN = 2 * 28 * 4 * 128 * 2


def model_dir(tmp_path: Path, cfg: dict[str, object]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_rows_average_4k_tokens_once_they_outgrow_one_context() -> None:
    assert ROW_TOKENS == 4096
    assert wanted_tokens(131072, 1) == 131072  # one row: the whole window, no 32k cap any more
    assert wanted_tokens(32768, 8) == 32768  # 8 x 4k: the same as one whole context
    assert wanted_tokens(32768, 16) == 65536
    assert wanted_tokens(8192, 8) == 8 * 4096
    assert wanted_tokens(2048, 8) == 8 * 2048  # a row shorter than 4k books its own context


@given(st.integers(1, 1 << 20), st.integers(1, 256))
def test_never_less_than_one_context_and_grows_with_the_batch(context: int, batch: int) -> None:
    tokens = wanted_tokens(context, batch)
    assert context <= tokens <= batch * context
    assert wanted_tokens(context, batch + 1) >= tokens


def test_kv_bytes_per_token() -> None:
    assert kv_bytes_per_token(QWEN_7B) == PER_TOKEN == 57344
    assert kv_bytes_per_token({**QWEN_7B, "torch_dtype": "float32"}) == 2 * PER_TOKEN
    assert kv_bytes_per_token({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8}) == 2 * 2 * 4 * 8 * 2
    assert kv_bytes_per_token({}) == 0


def test_footprint_uses_the_shared_rule_not_a_copy() -> None:
    assert footprint.kv_bytes_per_token is kv_bytes_per_token
    assert footprint.size_engine is size_engine


def test_estimate_books_the_sizing_the_engine_will_choose(tmp_path: Path) -> None:
    path = model_dir(tmp_path, QWEN_7B)  # a 32k window
    assert estimate_bytes(path, 1000) == 1000 + 32768 * PER_TOKEN  # batch 1: the whole window
    assert estimate_bytes(path, 1000, batch=8) == 1000 + 32768 * PER_TOKEN
    assert estimate_bytes(path, 1000, batch=16) == 1000 + 65536 * PER_TOKEN
    assert estimate_bytes(path, 1000, 8192, 8) == 1000 + 32768 * PER_TOKEN
    assert estimate_bytes(path, 1000, 8192, 1) == 1000 + 8192 * PER_TOKEN
    long = model_dir(tmp_path, {**QWEN_7B, "max_position_embeddings": 131072})
    assert estimate_bytes(long, 1000, batch=1) == 1000 + 131072 * PER_TOKEN  # no 32k cap: the window


def test_estimate_of_auto_is_the_width_memory_and_the_device_allow(tmp_path: Path) -> None:
    path = model_dir(tmp_path, QWEN_7B)
    weights, cache = 4 * GIB, GIB
    big = estimate_bytes(path, weights, batch=None, memory_bytes=500 * GIB, prompt_cache_bytes=cache, device="cpu")
    assert big == weights + AUTO_WIDTH_CAP["cpu"] * ROW_TOKENS * PER_TOKEN  # the CPU's widest
    small = 12 * GIB  # a 16 GB Mac's working set
    kv = estimate_bytes(path, weights, batch=None, memory_bytes=small, prompt_cache_bytes=cache, device="metal") - weights
    sizing = size_engine(width=None, context=32768, device="metal",
                         memory_tokens=kv_memory_tokens(small, weights, cache, PER_TOKEN))
    assert kv == sizing.kv_budget_tokens * PER_TOKEN
    assert weights + cache + kv <= small  # never over-commits
    # A configured width past what memory holds is booked at what memory holds, not more.
    wide = estimate_bytes(path, weights, batch=64, memory_bytes=small, prompt_cache_bytes=cache, device="metal")
    assert wide <= small - cache


def test_estimate_reads_a_nested_text_config(tmp_path: Path) -> None:
    path = model_dir(tmp_path, {"text_config": {**QWEN_7B, "max_position_embeddings": 4096}})
    assert estimate_bytes(path, 0, batch=4) == 4 * 4096 * PER_TOKEN
    assert text_config({"text_config": {"a": 1}, "b": 2}) == {"text_config": {"a": 1}, "a": 1, "b": 2}


def test_estimate_without_a_config_is_the_weights(tmp_path: Path) -> None:
    assert estimate_bytes(tmp_path, 1234, batch=8) == 1234


def test_memory_module_imports_no_mlx() -> None:
    code = (
        "import sys, mlxd.protocol.memory\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'psutil')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "[]"


def test_a_ranks_share_splits_the_layers_and_keeps_the_rest_whole(tmp_path: Path) -> None:
    tensors = {"model.embed_tokens.weight": 1000, "lm_head.weight": 1000, "model.norm.weight": 8}
    tensors |= {f"model.layers.{i}.mlp.up_proj.weight": 2000 for i in range(4)}
    tensors |= {f"model.layers.{i}.input_layernorm.weight": 8 for i in range(4)}
    path = fake_weights(tmp_path / "m", tensors)
    on_disk = sum(tensors.values())
    whole, layers = 2008, 8032
    assert footprint.group_share(path, on_disk, 2, "tensor") == (whole + layers // 2, 0.5)
    assert footprint.group_share(path, on_disk, 4, "tensor") == (whole + layers // 4, 0.25)
    assert footprint.group_share(path, on_disk, 3, "pipeline") == (whole + layers // 2, 0.5)  # 2 of 4 layers the most
    weights, share = footprint.group_share(path, 2 * on_disk, 2, "tensor")  # the pool's size is twice the headers'
    assert (weights, share) == (2 * (whole + layers // 2), 0.5)
    blank = tmp_path / "blank"
    blank.mkdir()
    assert footprint.group_share(blank, 1001, 2, "tensor") == (501, 0.5)  # unreadable: all split, rounded up
