"""The completion budget against the context window."""

from __future__ import annotations

import pytest

from mlxd.engine.http.openai_requests import resolve_max_tokens
from mlxd.protocol.errors import APIError


def test_default_budget_is_the_rest_of_the_window() -> None:
    assert resolve_max_tokens(None, 100, 1000, None) == 900
    assert resolve_max_tokens(None, 100, 1000, 16) == 16
    assert resolve_max_tokens(None, 995, 1000, 16) == 5


def test_requested_budget_that_fits() -> None:
    assert resolve_max_tokens(900, 100, 1000, None) == 900


def test_a_budget_past_the_window_is_clamped_to_the_room_left() -> None:
    assert resolve_max_tokens(901, 100, 1000, None) == 900
    assert resolve_max_tokens(32000, 100, 1000, 16) == 900  # an explicit one wins over the default
    assert resolve_max_tokens(32000, 100, 8192, None, kv_budget=2048) == 1948  # the KV budget ends first


def test_prompt_alone_too_long() -> None:
    with pytest.raises(APIError) as info:
        resolve_max_tokens(None, 1000, 1000, None)
    assert "1000" in info.value.message and info.value.code == "context_length_exceeded"
    with pytest.raises(APIError):
        resolve_max_tokens(5, 1000, 1000, None)
