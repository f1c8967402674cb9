"""The engine's command line (mlxd/engine/settings.py): defaults and refusals."""

from __future__ import annotations

import pytest

from mlxd.engine.settings import parse_args

BASE = ["--model", "/m", "--model-id", "m", "--socket", "/tmp/s.sock"]


def test_gather_ms_defaults_to_5_and_0_turns_it_off() -> None:
    assert parse_args(BASE).gather_ms == 5.0
    assert parse_args([*BASE, "--gather-ms", "0"]).gather_ms == 0.0
    assert parse_args([*BASE, "--gather-ms", "2.5"]).gather_ms == 2.5


@pytest.mark.parametrize("value", ["-1", "1001", "soon"])
def test_a_bad_gather_ms_is_refused_with_a_message(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*BASE, "--gather-ms", value])
    assert exit_info.value.code == 2
    assert "--gather-ms" in capsys.readouterr().err
