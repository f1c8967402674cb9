"""The engine's modules stay within the house sizes (STYLE.md 7): under ~500 lines a module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "mlxd" / "engine"
MAX_MODULE_LINES = 500


@pytest.mark.parametrize("path", sorted(ENGINE.rglob("*.py")), ids=lambda p: str(p.relative_to(ENGINE)))
def test_each_engine_module_is_under_500_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) < MAX_MODULE_LINES


def methods_of(path: Path, name: str) -> list[str]:
    tree = ast.parse(path.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    return [n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def test_the_gateway_is_the_loop_only_in_under_25_methods() -> None:
    # Scheduling is scheduler.py's, the lanes' turns runner.py's, loading loader.py's.
    methods = methods_of(ENGINE / "gpu" / "gateway.py", "Gateway")
    assert len(methods) <= 25
    assert not {"_admit", "_warm_up", "_make_lanes", "_merge_lanes"} & set(methods)
