"""Sizes as people read them, for the CLI and the hub puller alike (pure: no I/O)."""

from __future__ import annotations


def format_size(num_bytes: int | float | None) -> str:
    """Decimal units like `ollama`: 512 B, 4.7 GB, 540 MB; `-` when unknown."""
    if num_bytes is None:
        return "-"
    value = float(num_bytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            break
        value /= 1000
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.1f} {unit}" if abs(value) < 10 else f"{value:.0f} {unit}"
