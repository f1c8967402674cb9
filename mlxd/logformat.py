"""How the daemon's log lines look: the text people read, or one JSON object per line.

`mlxd serve` installs one of these on the root logger (`setup_logging`); the engines'
lines reach it relayed by the supervisor (`[model] ...`), so they take the same format.
Imported on the supervisor's start-up path: stdlib only.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# A line about one engine, `[model] text`; an engine's own line relayed by the supervisor
# (`Engine._relay_log`) is `[model] LEVEL logger: text`, the engine's format less its time.
_MODEL_PREFIX = re.compile(r"^\[([^\]\s]+)\] (.*)", re.DOTALL)
_ENGINE_LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+): (.*)", re.DOTALL)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, then model, exc and access fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {"ts": iso_time(record.created), "level": record.levelname, "logger": record.name}
        line.update(split_message(record.getMessage()))
        if record.exc_info:
            record.exc_text = record.exc_text or self.formatException(record.exc_info)
        if record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            for key, value in access.items():  # the request's fields; never over ts/level/logger/msg
                line.setdefault(str(key), value)
        # default=str: a value the supervisor put in `access` that JSON lacks still gets logged.
        return json.dumps(line, ensure_ascii=False, default=str)


def split_message(msg: str) -> dict[str, str]:
    """`msg`, less a `[model] ` prefix, which becomes `model`; a relayed engine line's level and logger are its own."""
    if (about := _MODEL_PREFIX.match(msg)) is None:
        return {"msg": msg}
    model, rest = about.groups()
    if (engine := _ENGINE_LINE.match(rest)) is None:
        return {"msg": rest, "model": model}
    level, logger, text = engine.groups()
    return {"level": level, "logger": logger, "msg": text, "model": model}


def iso_time(created: float) -> str:
    """A record's time as ISO 8601 in UTC with milliseconds: 2025-01-02T03:04:05.678Z."""
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def make_formatter(log_format: str) -> logging.Formatter:
    """The formatter for `--log-format` (`text` or `json`)."""
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")


def setup_logging(log_format: str, level: str | int) -> None:
    """Send every logger's records to stderr in `log_format`, at `level` and above."""
    handler = logging.StreamHandler()
    handler.setFormatter(make_formatter(log_format))
    logging.basicConfig(level=level, handlers=[handler])
    logging.captureWarnings(True)  # Python's warnings too, as log lines: a JSON log stays JSON
