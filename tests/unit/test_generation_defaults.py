"""A model's generation_config.json: sane defaults are used, absurd ones are dropped."""

from __future__ import annotations

from pathlib import Path

from mlxd.engine.models.loaded_model import generation_defaults


def defaults(tmp_path: Path, text: str) -> dict[str, float]:
    (tmp_path / "generation_config.json").write_text(text)
    return generation_defaults(tmp_path)


def test_sane_values_are_kept(tmp_path: Path) -> None:
    got = defaults(tmp_path, '{"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0, "repetition_penalty": 1.1}')
    assert got == {"temperature": 0.6, "top_p": 0.95, "top_k": 20.0, "min_p": 0.0, "repetition_penalty": 1.1}


def test_infinite_nan_huge_and_wrong_types_are_dropped(tmp_path: Path) -> None:
    text = '{"temperature": Infinity, "top_p": NaN, "top_k": 1e30, "min_p": -1, "repetition_penalty": true}'
    assert defaults(tmp_path, text) == {}


def test_not_an_object_or_not_json(tmp_path: Path) -> None:
    assert defaults(tmp_path, "[1, 2]") == {}
    assert defaults(tmp_path, "{") == {}
    assert generation_defaults(tmp_path / "missing") == {}
