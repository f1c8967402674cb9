"""The completion budget against the context window."""

from __future__ import annotations

import pytest

from mlxd.engine.http.openai_routes import resolve_max_tokens
from mlxd.protocol.errors import APIError


def test_default_budget_is_the_rest_of_the_window() -> None:
    assert resolve_max_tokens(None, 100, 1000, None) == 900
    assert resolve_max_tokens(None, 100, 1000, 16) == 16
    assert resolve_max_tokens(None, 995, 1000, 16) == 5


def test_requested_budget_that_fits() -> None:
    assert resolve_max_tokens(900, 100, 1000, None) == 900


def test_over_the_window_names_both_numbers() -> None:
    with pytest.raises(APIError) as info:
        resolve_max_tokens(901, 100, 1000, None)
    assert info.value.status == 400
    assert "100" in info.value.message and "901" in info.value.message and "1000" in info.value.message
    assert info.value.code == "context_length_exceeded"


def test_prompt_alone_too_long() -> None:
    with pytest.raises(APIError) as info:
        resolve_max_tokens(None, 1000, 1000, None)
    assert "1000" in info.value.message
