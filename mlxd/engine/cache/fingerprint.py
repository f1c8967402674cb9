"""What makes KV computed by one engine usable by another: the SSD tier's directory name.

KV cached on disk may only be restored by an engine that would have computed the same KV:
the same architecture and config, the same weights, the same tokenizer (the same token ids
for a prompt), the same KV settings (quantized or not), and an MLX / mlx-lm that lays the cache
out the same way. The fingerprint is a hash of all of these; each set of them gets its own
dir under `<data dir>/kv/`, and `fingerprint.json` there says what went into it.

The weights are not read whole (many GB): each file's name, size, safetensors header, and
64 KiB samples at 16 evenly spaced offsets identify it. Two checkpoints that differ only
outside every sample would share a fingerprint; for fine-tunes and quantizations, which touch
every tensor, that does not happen.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from importlib import metadata
from pathlib import Path
from typing import Any

FORMAT = 1
SAMPLES = 16
SAMPLE_BYTES = 64 * 1024
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)


def describe(model_dir: Path, kv_bits: int | None, kv_group_size: int, split: str | None = None) -> dict[str, Any]:
    """Everything the fingerprint covers, as JSON-able values (`split`: which part of the model an
    engine group's rank holds, `tensor 1/2`: its KV is of that part only)."""
    config = json.loads((model_dir / "config.json").read_text())
    return {
        **({"split": split} if split is not None else {}),
        "format": FORMAT,
        "config": config,
        "weights": [_weights_id(p) for p in sorted(model_dir.glob("*.safetensors"))],
        "tokenizer": {
            name: hashlib.sha256((model_dir / name).read_bytes()).hexdigest()
            for name in TOKENIZER_FILES if (model_dir / name).is_file()
        },
        "kv": {"bits": kv_bits, "group_size": kv_group_size if kv_bits else None},
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
    }


def fingerprint(description: dict[str, Any]) -> str:
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def tier_dir(root: Path, model_dir: Path, kv_bits: int | None, kv_group_size: int, split: str | None = None) -> Path:
    """`root/<fingerprint>`, created (0700) with its `fingerprint.json`."""
    desc = describe(model_dir, kv_bits, kv_group_size, split)
    path = root / fingerprint(desc)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    note = path / "fingerprint.json"
    if not note.exists():
        shown = {**desc, "config": {k: desc["config"].get(k) for k in ("model_type", "hidden_size", "num_hidden_layers")}}
        temp = path / f".fingerprint.{os.getpid()}.tmp"
        temp.write_text(json.dumps(shown, indent=2, sort_keys=True) + "\n")
        os.replace(temp, note)
    return path


def _weights_id(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) == 8:
            (n,) = struct.unpack("<Q", raw)
            h.update(f.read(min(n, 100 * 1024 * 1024)))
        for i in range(SAMPLES):
            f.seek(size * i // SAMPLES)
            h.update(f.read(SAMPLE_BYTES))
    return {"name": path.name, "size": size, "sha256_sampled": h.hexdigest()}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
