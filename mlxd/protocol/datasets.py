"""Fine-tune datasets as mlx-lm's tuner reads them: a dir of JSON-lines files, checked line by line.

`train.jsonl` and `valid.jsonl` (and an optional `test.jsonl`), one JSON object a line, all in one
of mlx-lm's formats: chat (`{"messages": [{"role", "content"}, ...]}`, optionally `tools`),
completions (`{"prompt", "completion"}`) or plain text (`{"text"}`). The check finds every line
that is not JSON, not an object, or not in the file's format, and says which and why, before
any training starts (the supervisor runs it when a fine-tune is submitted; no mlx needed).
Token lengths need the model's tokenizer: the worker counts them (lab/finetune.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import msgspec

Format = Literal["chat", "completions", "text"]
SPLITS = ("train", "valid", "test")
REQUIRED = ("train", "valid")
MAX_LISTED = 20  # bad lines named per file
ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class BadLine(msgspec.Struct):
    line: int
    reason: str


class FileReport(msgspec.Struct, kw_only=True):
    split: str
    path: str
    rows: int = 0
    format: Format | None = None
    num_bad: int = 0
    bad: list[BadLine] = msgspec.field(default_factory=list)


class DatasetError(Exception):
    """The dataset cannot be trained on; the message says what to fix."""


def format_of(row: dict[str, Any]) -> Format | None:
    if "messages" in row:
        return "chat"
    if "prompt" in row and "completion" in row:
        return "completions"
    if "text" in row:
        return "text"
    return None


def row_problem(row: Any, fmt: Format) -> str | None:
    """Why `row` is not a good row of a `fmt` file (None: it is)."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    found = format_of(row)
    if found != fmt:
        return f"not in the file's {fmt} format (keys: {', '.join(sorted(row)[:6]) or 'none'})"
    if fmt == "chat":
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            return "`messages` must be a non-empty list"
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return f"messages[{i}] needs a `role`"
            if m["role"] not in ROLES:
                return f"messages[{i}] has role {m['role']!r}"
            if not isinstance(m.get("content"), str | list) and not m.get("tool_calls"):
                return f"messages[{i}] needs a `content` string"
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
            return "no assistant message to learn from"
    elif fmt == "completions":
        if not isinstance(row["prompt"], str) or not isinstance(row["completion"], str):
            return "`prompt` and `completion` must be strings"
        if not row["completion"]:
            return "`completion` is empty"
    elif not isinstance(row["text"], str) or not row["text"].strip():
        return "`text` must be a non-empty string"
    return None


def check_file(path: Path, split: str) -> FileReport:
    """Every line of one file: its format (the first good row's) and its bad lines."""
    report = FileReport(split=split, path=str(path))
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise DatasetError(f"{path} cannot be read: {exc.strerror or exc}") from None

    def bad(number: int, reason: str) -> None:
        report.num_bad += 1
        if len(report.bad) < MAX_LISTED:
            report.bad.append(BadLine(number, reason))

    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            bad(number, f"not JSON: {exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError)
                else f"not JSON: {exc}")
            continue
        if report.format is None and isinstance(row, dict):
            report.format = format_of(row)
            if report.format is None:
                bad(number, f"not a chat, completions or text row (keys: {', '.join(sorted(row)[:6]) or 'none'})")
                continue
        if report.format is None:
            bad(number, f"a JSON {type(row).__name__}, not an object")
            continue
        if (problem := row_problem(row, report.format)) is not None:
            bad(number, problem)
            continue
        report.rows += 1
    return report


def check_dir(data: Path) -> list[FileReport]:
    """Every split file in `data`; DatasetError when one is missing, empty or has bad lines,
    naming each bad line (up to MAX_LISTED a file)."""
    if not data.is_dir():
        raise DatasetError(f"{data} is not a dir (a fine-tune's data is a dir holding train.jsonl and valid.jsonl)")
    missing = [f"{s}.jsonl" for s in REQUIRED if not (data / f"{s}.jsonl").is_file()]
    if missing:
        raise DatasetError(f"{data} has no {' or '.join(missing)} (it needs train.jsonl and valid.jsonl)")
    reports = [check_file(data / f"{s}.jsonl", s) for s in SPLITS if (data / f"{s}.jsonl").is_file()]
    problems = []
    for r in reports:
        if r.num_bad:
            listed = "; ".join(f"line {b.line}: {b.reason}" for b in r.bad)
            more = f" (and {r.num_bad - len(r.bad)} more)" if r.num_bad > len(r.bad) else ""
            problems.append(f"{Path(r.path).name}: {r.num_bad} bad line(s): {listed}{more}")
        elif r.rows == 0:
            problems.append(f"{Path(r.path).name} has no rows")
    formats = {r.format for r in reports if r.format is not None}
    if len(formats) > 1:
        problems.append(f"the files are in different formats ({', '.join(sorted(formats))})")
    if problems:
        raise DatasetError(" | ".join(problems))
    return reports
