"""Fine-tune datasets checked line by line before training (mlxd/protocol/datasets.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxd.protocol.datasets import DatasetError, check_dir, check_file

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def write(path: Path, *rows: object, raw: str = "") -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows) + raw)
    return path


def test_each_format_is_recognised_and_counted(tmp_path: Path) -> None:
    assert check_file(write(tmp_path / "a.jsonl", CHAT, CHAT, ""), "train").format == "chat"
    completions = check_file(write(tmp_path / "b.jsonl", {"prompt": "2+2", "completion": "4"}), "train")
    assert (completions.format, completions.rows, completions.num_bad) == ("completions", 1, 0)
    assert check_file(write(tmp_path / "c.jsonl", {"text": "hello"}), "train").format == "text"


def test_bad_lines_are_named_with_their_reason(tmp_path: Path) -> None:
    report = check_file(write(
        tmp_path / "t.jsonl", CHAT, "{oops", [1, 2], {"text": "wrong format"},
        {"messages": [{"role": "user", "content": "no answer"}]},
        {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}), "train")
    assert report.rows == 1 and report.num_bad == 5
    reasons = {b.line: b.reason for b in report.bad}
    assert reasons[2].startswith("not JSON") and "list, not an object" in reasons[3]
    assert "chat format" in reasons[4] and "no assistant" in reasons[5] and "'wizard'" in reasons[6]


def test_a_dir_needs_train_and_valid_and_reports_every_problem(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not a dir"):
        check_dir(tmp_path / "nope")
    with pytest.raises(DatasetError, match=r"train\.jsonl or valid\.jsonl"):
        check_dir(tmp_path)
    write(tmp_path / "train.jsonl", CHAT, "{bad")
    write(tmp_path / "valid.jsonl", {"prompt": "p", "completion": "c"})
    with pytest.raises(DatasetError) as err:
        check_dir(tmp_path)
    assert "train.jsonl: 1 bad line(s): line 2: not JSON" in str(err.value)
    assert "different formats" in str(err.value)
    write(tmp_path / "train.jsonl", CHAT)
    write(tmp_path / "valid.jsonl", CHAT)
    assert [r.split for r in check_dir(tmp_path)] == ["train", "valid"]
    (tmp_path / "valid.jsonl").write_bytes(b"\xff\xfe")
    with pytest.raises(DatasetError, match="not UTF-8"):
        check_dir(tmp_path)


def test_only_the_first_bad_lines_are_listed(tmp_path: Path) -> None:
    report = check_file(write(tmp_path / "t.jsonl", CHAT, *["{"] * 50), "train")
    assert report.num_bad == 50 and len(report.bad) == 20
