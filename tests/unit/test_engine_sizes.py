"""The engine's modules stay within the house sizes (STYLE.md 7): under ~500 lines a module."""

from __future__ import annotations

from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "mlxd" / "engine"
MAX_MODULE_LINES = 500


@pytest.mark.parametrize("path", sorted(ENGINE.rglob("*.py")), ids=lambda p: str(p.relative_to(ENGINE)))
def test_each_engine_module_is_under_500_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) < MAX_MODULE_LINES
