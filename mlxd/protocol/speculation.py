"""Speculative decoding's settings, shared by the supervisor's config and the engine's flags.

What a model drafts with (`--draft`, `[pool] draft`, `[models.NAME] draft`):

- `none`: no drafts;
- `ngram`: drafts copied from the request's own context (prompt lookup);
- `self:N`: the model's own first N layers and its head (a layer-skip self-draft);
- anything else names a draft model: a model of the same tokenizer, by the name mlxd lists
  it under or by its directory (the engine is given the directory).
"""

from __future__ import annotations

DRAFT_KINDS = ("none", "ngram", "self", "model")
DEFAULT_NUM_DRAFT_TOKENS = 4  # the most drafted tokens one pass checks
SELF_PREFIX = "self:"


def parse_draft(value: str) -> tuple[str, int, str]:
    """(kind, layers, model) from a draft setting; raises ValueError saying what is wrong.

    `layers` is a self-draft's layer count (0 otherwise), `model` a draft model's name or
    directory ("" otherwise)."""
    text = value.strip()
    if not text:
        raise ValueError("draft must be none, ngram, self:N or a draft model's name or directory")
    if text in ("none", "ngram"):
        return text, 0, ""
    if text.startswith(SELF_PREFIX):
        count = text[len(SELF_PREFIX):]
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"draft {value!r}: self:N takes the number of the model's first layers that draft "
                             "(a whole number, at least 1)")
        return "self", int(count), ""
    return "model", 0, text
