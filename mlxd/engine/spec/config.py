"""What a model drafts with (the engine's `--draft` and `--num-draft-tokens`)."""

from __future__ import annotations

from dataclasses import dataclass

from mlxd.protocol.speculation import DEFAULT_NUM_DRAFT_TOKENS, DRAFT_KINDS, parse_draft

__all__ = ["DEFAULT_NUM_DRAFT_TOKENS", "DRAFT_KINDS", "DraftConfig"]


@dataclass(frozen=True, slots=True)
class DraftConfig:
    """`kind`: "none"; "ngram" (drafts from the row's own context, ngram.py); "self" (the model's
    first `layers` layers, drafters.py); "model" (the draft model in directory `model`)."""

    kind: str = "none"
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS  # the most drafts a verification takes
    layers: int = 0
    model: str = ""

    @classmethod
    def parse(cls, value: str, num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS) -> DraftConfig:
        kind, layers, model = parse_draft(value)
        return cls(kind, num_draft_tokens, layers, model)

    @property
    def label(self) -> str:
        """As the engine's stats name it."""
        return {"self": f"self:{self.layers}", "model": f"model:{self.model}"}.get(self.kind, self.kind)
