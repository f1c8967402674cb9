"""An embedding model: mlx-embeddings' model class, its tokenizer, its pooling, its window.

Loaded and run on the GPU thread (gateway.py); `tokenize` is pure CPU and runs on the loop's
executor. A forward takes right-padded rows and gives one unit-length float32 vector a row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxd.engine.embed import pooling
from mlxd.engine.models.load_meter import LoadMeter
from mlxd.engine.models.loaded_model import ModelLoadError, read_weights
from mlxd.protocol.capabilities import is_embedding_config
from mlxd.protocol.embeddings import Inputs
from mlxd.protocol.errors import APIError
from mlxd.protocol.memory import context_window

EXTRA_HINT = "embedding models need mlx-embeddings: pip install 'mlxd[embeddings]'"
# RoBERTa's family numbers positions from padding_idx + 1: two of max_position_embeddings are
# never a token's.
POSITION_OFFSET = {"roberta": 2, "xlm-roberta": 2, "xlm_roberta": 2}


class Tokens:
    """The model's tokenizer: tokenizer.json through `tokenizers`, else transformers' (which
    builds one from vocab.txt and the like)."""

    def __init__(self, path: Path) -> None:
        self._fast: Any = None
        self._slow: Any = None
        if (path / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(str(path / "tokenizer.json"))
            self._fast.no_padding()
            self._fast.no_truncation()
        else:
            from transformers import AutoTokenizer

            self._slow = AutoTokenizer.from_pretrained(str(path))
        self.pad_id = self._pad_id(path)

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self._fast is not None:
            return [list(e.ids) for e in self._fast.encode_batch(texts, add_special_tokens=True)]
        return [list(ids) for ids in self._slow(texts, add_special_tokens=True)["input_ids"]]

    def _pad_id(self, path: Path) -> int:
        try:
            config = json.loads((path / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            config = {}
        token = config.get("pad_token") if isinstance(config, dict) else None
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and self._fast is not None and (found := self._fast.token_to_id(token)) is not None:
            return int(found)
        if self._slow is not None and self._slow.pad_token_id is not None:
            return int(self._slow.pad_token_id)
        return 0  # masked out either way: any id in the vocabulary will do


def is_embedding_dir(path: Path) -> bool:
    """Whether the engine serves `path` as an embedding model (protocol/capabilities.py says which)."""
    try:
        config = json.loads((path / "config.json").read_text())
        files = {p.name for p in path.iterdir()}
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and is_embedding_config(config, files)


def import_mlx_embeddings() -> Any:
    try:
        import mlx_embeddings.utils
    except ImportError as exc:
        raise ModelLoadError(f"{EXTRA_HINT} ({exc})") from exc
    return mlx_embeddings.utils


class EmbeddingModel:
    """The weights, tokenizer and pooling of one embedding model."""

    def __init__(self, path: Path, model_id: str, max_context: int | None = None,
                 meter: LoadMeter | None = None) -> None:
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not an MLX model dir (no config.json)")
        meu = import_mlx_embeddings()
        meter = meter or LoadMeter()
        try:
            self.pooling = pooling.read(path)
            self.model: nn.Module = meu.load_model(path, lazy=True)
            read_weights(self.model, meter)
            meter.begin("tokenizer")
            self.tokens = Tokens(path)
        except (pooling.PoolingError, ModelLoadError) as exc:
            raise ModelLoadError(f"cannot load {path}: {exc}") from exc
        except Exception as exc:  # mlx-embeddings raises many kinds; all mean "cannot load"
            raise ModelLoadError(f"cannot load {path}: {type(exc).__name__}: {exc}") from exc
        self.path = path
        self.model_id = model_id
        self.config = json.loads((path / "config.json").read_text())
        offset = POSITION_OFFSET.get(str(self.config.get("model_type")), 0)
        native = context_window(self.config, None) - offset
        self.context_window = min(native, max_context) if max_context else native
        self.vocab_size = int(self.config.get("vocab_size") or 0)
        self.dimensions = 0  # the vectors' length, found by the first forward (gateway's warm-up)

    def tokenize(self, inputs: Inputs, truncate: bool) -> list[list[int]]:
        """Each input's token ids (texts with the tokenizer's special tokens, token lists as
        they are); past the window: cut to it when `truncate`, else a 400 naming the input."""
        if isinstance(inputs[0], str):
            rows = self.tokens.encode(list(inputs))
        else:
            rows = [list(ids) for ids in inputs]
            for i, ids in enumerate(rows):
                if bad := [t for t in ids if not 0 <= t < self.vocab_size]:
                    raise APIError(400, f"input[{i}] holds token id {bad[0]}, outside the vocabulary "
                                   f"(0-{self.vocab_size - 1}).", param="input")
        for i, ids in enumerate(rows):
            if len(ids) > self.context_window:
                if not truncate:
                    where = "input" if len(rows) == 1 else f"input[{i}]"
                    raise APIError(400, f"{where} is {len(ids)} tokens; model {self.model_id} embeds at most "
                                   f"{self.context_window}.", param="input", code="context_length_exceeded")
                rows[i] = ids[: self.context_window]
        return rows

    def forward(self, rows: list[list[int]]) -> np.ndarray:
        """Unit vectors for `rows` (token id lists), float32, one row each: GPU thread only."""
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), self.tokens.pad_id, dtype=np.int32)
        mask = np.zeros((len(rows), width), dtype=np.int32)  # integral: some families index by its sums
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
            mask[i, : len(r)] = 1
        out = self.model(mx.array(ids), attention_mask=mx.array(mask))
        hidden = getattr(out, "last_hidden_state", None)
        if self.pooling.modes and hidden is not None and hidden.ndim == 3:
            lengths = mx.array([len(r) for r in rows], dtype=mx.int32)
            vectors = pooling.pool(hidden, mx.array(mask), lengths, self.pooling.modes)
        else:
            vectors = out.text_embeds
        vectors = pooling.unit(vectors.astype(mx.float32))
        return np.array(vectors, copy=False)
