"""Speculative decoding's settings, shared by the supervisor's config and the engine's flags."""

from __future__ import annotations

DRAFT_KINDS = ("none", "ngram")  # none: off; ngram: drafts from the request's own context
DEFAULT_NUM_DRAFT_TOKENS = 4  # the most drafted tokens one pass checks
