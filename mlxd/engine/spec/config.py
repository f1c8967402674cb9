"""What a model drafts with (the engine's `--draft` and `--num-draft-tokens`)."""

from __future__ import annotations

from dataclasses import dataclass

from mlxd.protocol.speculation import DEFAULT_NUM_DRAFT_TOKENS, DRAFT_KINDS

__all__ = ["DEFAULT_NUM_DRAFT_TOKENS", "DRAFT_KINDS", "DraftConfig"]


@dataclass(frozen=True, slots=True)
class DraftConfig:
    kind: str = "none"  # "none" or "ngram": drafts from the row's own context (ngram.py)
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS  # the most drafts a verification takes
