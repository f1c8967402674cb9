"""How much KV cache an engine plans for: one rule, read by the engine and the supervisor's pool.

Pure arithmetic on a model's config.json values; no mlx, no I/O.
"""

from __future__ import annotations

from typing import Any

# KV is sized for the model's context window, but not past this unless `max_context` asks:
# the cache grows with use, and a 128k window would otherwise book memory no chat uses.
KV_CONTEXT_CAP = 32768
# What one of several concurrent rows is planned to hold on average: most chats are short, so
# booking every row's whole context would keep a batched engine from loading at all.
ROW_TOKENS = 4096
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def head_size(cfg: dict[str, Any]) -> int:
    """One attention head's size (0 when the config lacks the sizes)."""
    heads = int(cfg.get("num_attention_heads") or 0)
    return int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // heads if heads else 0))


def kv_bytes_per_token(cfg: dict[str, Any]) -> int:
    """Keys and values for one token across all layers (0 when the config lacks the sizes)."""
    layers = int(cfg.get("num_hidden_layers") or 0)
    heads = int(cfg.get("num_attention_heads") or 0)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = head_size(cfg)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16")
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 2)


def kv_budget_tokens(window: int, batch: int, max_context: int | None = None) -> int:
    """Tokens of KV cache across all `batch` rows: the larger of one whole context and 4k a row.

    One row may always fill its whole context (`max_context`, else the window capped at 32k),
    while concurrent rows are planned at ROW_TOKENS each, so batch=1 books what it always has.
    """
    context = max_context or min(window, KV_CONTEXT_CAP)
    return max(context, batch * min(context, ROW_TOKENS))


# The prompt cache's RAM tier by default: this share of physical memory, within these bounds.
PROMPT_CACHE_SHARE = 0.10
PROMPT_CACHE_MIN = 512 * 1024 * 1024
PROMPT_CACHE_MAX = 32 * 1024**3


def default_prompt_cache_bytes(total_memory: int) -> int:
    """The RAM tier's byte cap when none is set: 10% of memory, at least 512 MiB, at most 32 GiB."""
    return int(min(PROMPT_CACHE_MAX, max(PROMPT_CACHE_MIN, total_memory * PROMPT_CACHE_SHARE)))
