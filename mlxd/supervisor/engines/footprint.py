"""How much memory an engine will take: its weights plus a KV cache for its rows.

An estimate for the pool's memory budget, made from files alone (no mlx in the supervisor);
the KV rule itself is `mlxd.protocol.memory`, shared with the engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil

from mlxd.protocol.memory import kv_budget_tokens, kv_bytes_per_token


def estimate_bytes(model_dir: Path, weights_bytes: int, max_context: int | None = None, batch: int = 1) -> int:
    """Weights plus the KV cache an engine running `batch` rows plans for (`kv_budget_tokens`)."""
    cfg = _text_config(model_dir)
    if cfg is None:
        return weights_bytes
    window = int(cfg.get("max_position_embeddings") or 4096)
    return weights_bytes + kv_budget_tokens(window, batch, max_context) * kv_bytes_per_token(cfg)


def default_budget_bytes(fraction: float) -> int:
    """`fraction` of physical memory."""
    return int(psutil.virtual_memory().total * fraction)


def _text_config(model_dir: Path) -> dict[str, Any] | None:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    text = cfg.get("text_config")
    return {**cfg, **text} if isinstance(text, dict) else cfg
