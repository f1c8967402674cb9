"""The lab's files (mlxd/supervisor/lab_files.py): the token kept with mode 0600 from its first
byte and never in the state it reports, and datasets listed from the datasets dir."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from mlxd.supervisor.lab_files import LabFiles, TokenState, check_token, write_private


def test_the_token_file_is_private_and_the_state_never_holds_the_token(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    lab = LabFiles(tmp_path)
    assert lab.token() is None and lab.token_state() == TokenState(has_token=False)
    old_umask = os.umask(0)  # the most permissive umask: the mode must not come from it
    try:
        lab.save_token("hf_abc123")
    finally:
        os.umask(old_umask)
    path = tmp_path / "hf_token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and lab.token() == "hf_abc123"
    assert "hf_abc" not in repr(lab.token_state()) and lab.token_state().source == "file"
    assert [p.name for p in tmp_path.iterdir()] == ["hf_token"]  # no temp file left
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    assert lab.token() == "hf_abc123"  # a saved token comes first
    assert lab.forget_token() and not lab.forget_token()
    assert lab.token() == "hf_env" and lab.token_state() == TokenState(has_token=True, source="env")


def test_saves_at_once_each_write_a_whole_private_file(tmp_path: Path) -> None:
    """Two saves at once (a fuzzer's concurrent POSTs found this) must not share a temp file."""
    import concurrent.futures

    target = tmp_path / "hf_token"
    texts = [f"hf_{i:03d}\n" for i in range(64)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda t: write_private(target, t), texts))  # raises if any save failed
    assert target.read_text() in texts and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["hf_token"]  # no temp file left behind


@pytest.mark.parametrize("bad", [None, 7, "", "   ", "two words", "tab\there", "x" * 401])
def test_a_token_must_be_one_printable_word(bad: object) -> None:
    with pytest.raises(ValueError):
        check_token(bad)
    assert check_token("  hf_ok\n") == "hf_ok"


def test_datasets_are_listed_with_rows_per_split_and_a_half_written_one_is_not(tmp_path: Path) -> None:
    lab = LabFiles(tmp_path)
    assert lab.datasets() == [] and lab.dataset_path("x") is None
    good = tmp_path / "datasets" / "good"
    good.mkdir(parents=True)
    (good / "train.jsonl").write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(3)))
    (good / "valid.jsonl").write_text(json.dumps({"text": "v"}) + "\n")
    (tmp_path / "datasets" / ".making.partial-1").mkdir()
    listed = lab.datasets()
    assert [(d.name, d.format, d.rows) for d in listed] == [("good", "text", {"train": 3, "valid": 1})]
    assert lab.dataset_path("good") == good
    assert lab.dataset_path("../good") is None and lab.dataset_path(".making.partial-1") is None
