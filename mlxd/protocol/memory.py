"""What a token's KV costs, and the prompt cache's default share: read by the engine and the pool.

How much KV an engine plans for, and its batch width, is protocol/sizing.py's rule.

Pure arithmetic on a model's config.json values; no mlx, no I/O.
"""

from __future__ import annotations

from typing import Any

# What one of several concurrent rows is planned to hold on average: most chats are short, so
# booking every row's whole context would keep a batched engine from loading at all.
ROW_TOKENS = 4096
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


DEFAULT_CONTEXT = 4096  # a config that names no window


def context_window(config: dict[str, Any], max_context: int | None) -> int:
    """The model's context length, capped by `max_context` (the engine's --max-context)."""
    native = config.get("max_position_embeddings") or config.get("max_seq_len") or DEFAULT_CONTEXT
    return min(int(native), max_context) if max_context else int(native)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config's language model's sizes: a vision-language model keeps them in `text_config`."""
    text = cfg.get("text_config")
    return {**cfg, **text} if isinstance(text, dict) else cfg


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


# The prompt cache's RAM tier by default: this share of physical memory, within these bounds.
PROMPT_CACHE_SHARE = 0.10
PROMPT_CACHE_MIN = 512 * 1024 * 1024
PROMPT_CACHE_MAX = 32 * 1024**3


def default_prompt_cache_bytes(total_memory: int) -> int:
    """The RAM tier's byte cap when none is set: 10% of memory, at least 512 MiB, at most 32 GiB."""
    return int(min(PROMPT_CACHE_MAX, max(PROMPT_CACHE_MIN, total_memory * PROMPT_CACHE_SHARE)))
