"""Keep the last request's KV cache so a follow-up sharing its prefix skips that prefill."""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Number of leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PromptCache:
    """A single-slot prompt cache for the serial lane (the KV cache issue grows this)."""

    def __init__(self, model: Any, max_kv_size: int | None = None) -> None:
        self._model = model
        self._max_kv_size = max_kv_size
        self._cache: list[Any] | None = None
        self._tokens: list[int] = []

    def fetch(self, prompt: list[int], min_share: float = 0.0) -> tuple[list[Any], int]:
        """Take a cache for `prompt` and how many of its tokens it already holds.

        A held prefix covering less than `min_share` of the prompt is not used (and stays held).
        """
        cache, held = self._cache, self._tokens
        if cache is None or not can_trim_prompt_cache(cache):
            return self._fresh(), 0
        # Leave at least one prompt token to run: its logits pick the first new token.
        reuse = min(common_prefix_len(held, prompt), len(prompt) - 1)
        if reuse <= 0 or reuse < min_share * len(prompt):
            return self._fresh(), 0
        self._cache, self._tokens = None, []
        trim_prompt_cache(cache, len(held) - reuse)
        return cache, reuse

    def store(self, cache: list[Any], tokens: list[int]) -> None:
        """Keep `cache`, which holds KV for a prefix of `tokens` (its offset says how much)."""
        offset = getattr(cache[0], "offset", None) if cache else None
        if not isinstance(offset, int) or offset > len(tokens):
            return
        self._cache, self._tokens = cache, tokens[:offset]

    def clear(self) -> None:
        """Drop what is held (after an error left the cache in an unknown state)."""
        self._cache, self._tokens = None, []

    def _fresh(self) -> list[Any]:
        return list(make_prompt_cache(self._model, max_kv_size=self._max_kv_size))
