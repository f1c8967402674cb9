"""The KV budget an engine plans for (protocol/memory.py) and the pool's estimate built on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from mlxd.protocol.memory import KV_CONTEXT_CAP, ROW_TOKENS, kv_budget_tokens, kv_bytes_per_token
from mlxd.supervisor.engines import footprint
from mlxd.supervisor.engines.footprint import estimate_bytes

# Qwen2.5-7B's shape: 28 layers, 4 KV heads of dim 128 (3584 / 28), bfloat16: 56 KiB a token.
QWEN_7B = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
           "torch_dtype": "bfloat16", "max_position_embeddings": 32768}
PER_TOKEN = 2 * 28 * 4 * 128 * 2


def model_dir(tmp_path: Path, cfg: dict[str, object]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_constants() -> None:
    assert (KV_CONTEXT_CAP, ROW_TOKENS) == (32768, 4096)


def test_one_row_books_its_context_capped_at_32k() -> None:
    assert kv_budget_tokens(8192, 1) == 8192
    assert kv_budget_tokens(131072, 1) == 32768
    assert kv_budget_tokens(131072, 1, max_context=65536) == 65536  # max_context passes the cap
    assert kv_budget_tokens(8192, 1, max_context=2048) == 2048


def test_rows_average_4k_tokens_once_they_outgrow_one_context() -> None:
    assert kv_budget_tokens(32768, 8) == 32768  # 8 x 4k: the same as one whole context
    assert kv_budget_tokens(32768, 16) == 65536
    assert kv_budget_tokens(8192, 8) == 8 * 4096
    assert kv_budget_tokens(131072, 256) == 256 * 4096


def test_a_row_shorter_than_4k_books_its_own_context() -> None:
    assert kv_budget_tokens(2048, 8) == 8 * 2048
    assert kv_budget_tokens(131072, 8, max_context=1000) == 8000


@given(st.integers(1, 1 << 20), st.integers(1, 256), st.one_of(st.none(), st.integers(1, 1 << 20)))
def test_never_less_than_one_context_and_grows_with_the_batch(window: int, batch: int, max_context: int | None) -> None:
    context = max_context or min(window, KV_CONTEXT_CAP)
    tokens = kv_budget_tokens(window, batch, max_context)
    assert tokens >= context
    assert tokens <= batch * context
    assert kv_budget_tokens(window, batch + 1, max_context) >= tokens


def test_kv_bytes_per_token() -> None:
    assert kv_bytes_per_token(QWEN_7B) == PER_TOKEN == 57344
    assert kv_bytes_per_token({**QWEN_7B, "torch_dtype": "float32"}) == 2 * PER_TOKEN
    assert kv_bytes_per_token({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8}) == 2 * 2 * 4 * 8 * 2
    assert kv_bytes_per_token({}) == 0


def test_footprint_uses_the_shared_rule_not_a_copy() -> None:
    assert footprint.kv_bytes_per_token is kv_bytes_per_token
    assert footprint.kv_budget_tokens is kv_budget_tokens


def test_estimate_counts_the_batch(tmp_path: Path) -> None:
    path = model_dir(tmp_path, QWEN_7B)
    assert estimate_bytes(path, 1000) == 1000 + 32768 * PER_TOKEN  # batch 1: as before
    assert estimate_bytes(path, 1000, batch=8) == 1000 + 32768 * PER_TOKEN
    assert estimate_bytes(path, 1000, batch=16) == 1000 + 65536 * PER_TOKEN
    assert estimate_bytes(path, 1000, 8192, 8) == 1000 + 32768 * PER_TOKEN
    assert estimate_bytes(path, 1000, 8192, 1) == 1000 + 8192 * PER_TOKEN


def test_estimate_reads_a_nested_text_config(tmp_path: Path) -> None:
    path = model_dir(tmp_path, {"text_config": {**QWEN_7B, "max_position_embeddings": 4096}})
    assert estimate_bytes(path, 0, batch=4) == 4 * 4096 * PER_TOKEN


def test_estimate_without_a_config_is_the_weights(tmp_path: Path) -> None:
    assert estimate_bytes(tmp_path, 1234, batch=8) == 1234


def test_memory_module_imports_no_mlx() -> None:
    code = (
        "import sys, mlxd.protocol.memory\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'psutil')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "[]"
