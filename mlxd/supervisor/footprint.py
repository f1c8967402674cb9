"""How much memory an engine will take: its weights plus a KV cache for its context.

An estimate for the pool's memory budget, made from files alone (no mlx in the supervisor).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil

# KV is sized for the model's context window, but not past this unless `max_context` asks:
# the cache grows with use, and a 128k window would otherwise book memory no chat uses.
KV_CONTEXT_CAP = 32768
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def estimate_bytes(model_dir: Path, weights_bytes: int, max_context: int | None = None) -> int:
    """Weights plus the KV cache for `max_context` tokens (default: the window, capped at 32k)."""
    cfg = _text_config(model_dir)
    if cfg is None:
        return weights_bytes
    window = int(cfg.get("max_position_embeddings") or 4096)
    context = max_context or min(window, KV_CONTEXT_CAP)
    return weights_bytes + context * kv_bytes_per_token(cfg)


def kv_bytes_per_token(cfg: dict[str, Any]) -> int:
    """Keys and values for one token across all layers (0 when the config lacks the sizes)."""
    layers = int(cfg.get("num_hidden_layers") or 0)
    heads = int(cfg.get("num_attention_heads") or 0)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // heads if heads else 0))
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16")
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 2)


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
