"""How a text's token vectors become one vector: the sentence-transformers Pooling module's
config where the model dir has one, else the model family's own pooling (mlx-embeddings').

Modes, as sentence-transformers names them: `cls` (the first token's vector), `mean` (the
average over the text's tokens), `max` (each number's largest over them) and `lasttoken` (the
last token's: decoder models such as Qwen3-Embedding). Several on at once are concatenated in
sentence-transformers' order. A dir whose modules run a Dense projection after pooling
(EmbeddingGemma) is pooled by mlx-embeddings' model itself, which applies it.
Every vector is then made unit length (L2), as OpenAI's and Ollama's embeddings are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

ORDER = ("cls", "max", "mean", "lasttoken")
KEYS = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens", "mean": "pooling_mode_mean_tokens",
        "lasttoken": "pooling_mode_lasttoken"}
UNSUPPORTED = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
DENSE = "sentence_transformers.models.Dense"
POOLING = "sentence_transformers.models.Pooling"


class PoolingError(ValueError):
    """The dir's pooling cannot be run (a mode mlxd lacks); a load error."""


@dataclass(frozen=True)
class Pooling:
    modes: tuple[str, ...]  # of ORDER; empty: the model's own `text_embeds`
    source: str  # where it was read, for the load log

    @property
    def label(self) -> str:
        return "+".join(self.modes) if self.modes else "the model family's own"


def read(path: Path) -> Pooling:
    """The dir's pooling (module docstring)."""
    modules = _json(path / "modules.json")
    entries = [m for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []
    if any(m.get("type") == DENSE for m in entries):
        return Pooling((), "modules.json (a Dense projection follows pooling)")
    where = next((str(m.get("path") or "") for m in entries if m.get("type") == POOLING), "1_Pooling")
    config = _json(path / where / "config.json")
    if not isinstance(config, dict):
        return Pooling((), "no sentence-transformers Pooling config")
    if bad := [k for k in UNSUPPORTED if config.get(k)]:
        raise PoolingError(f"{where}/config.json asks for {bad[0]}, which mlxd does not pool by")
    modes = tuple(mode for mode in ORDER if config.get(KEYS[mode]))
    return Pooling(modes, f"{where}/config.json")


def pool(hidden: mx.array, mask: mx.array, lengths: mx.array, modes: tuple[str, ...]) -> mx.array:
    """Rows' vectors from `hidden` (rows, tokens, width), right-padded: `mask` (rows, tokens)
    is 1 on a row's tokens, `lengths` (rows,) counts them."""
    parts = []
    weights = mask[..., None].astype(mx.float32)
    hidden = hidden.astype(mx.float32)
    for mode in modes:
        if mode == "cls":
            parts.append(hidden[:, 0])
        elif mode == "mean":
            parts.append((hidden * weights).sum(axis=1) / mx.maximum(weights.sum(axis=1), 1.0))
        elif mode == "max":
            parts.append(mx.where(weights > 0, hidden, -mx.inf).max(axis=1))
        else:  # lasttoken
            parts.append(hidden[mx.arange(hidden.shape[0]), lengths - 1])
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def unit(vectors: mx.array) -> mx.array:
    """Each row made unit length (a zero row stays zero)."""
    norms = mx.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / mx.maximum(norms, 1e-12)


def _json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None
