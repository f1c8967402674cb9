"""Model-free drafts: the tokens that followed the row's last few tokens where they last appeared.

Prompt lookup decoding: an agent rewriting a file, or repeating what it just read, produces
runs of tokens already in its context. The row's history (prompt and completion) is indexed
by its n-grams as it grows; a draft is what followed the most recent earlier occurrence of the
history's last `n` tokens, the longest `n` that has one first. Pure Python (dict lookups), so
a draft costs the GPU thread a few microseconds.
"""

from __future__ import annotations

# Suffix lengths tried, longest first: a 1-gram matches everywhere and is usually wrong.
MAX_NGRAM = 4
MIN_NGRAM = 2


class NgramDrafter:
    """Drafts for one row from its own history (`propose` is given the same growing list)."""

    __slots__ = ("_indexed", "_last", "_max_n", "_min_n")

    def __init__(self, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM) -> None:
        self._max_n = max_n
        self._min_n = min_n
        self._indexed = 0  # positions whose n-grams ending there are in `_last`
        # n-gram -> the position of its last token, at its most recent occurrence
        self._last: dict[tuple[int, ...], int] = {}

    def _index(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams ending at positions below `upto`."""
        last = self._last
        for end in range(self._indexed, upto):
            for n in range(self._min_n, min(self._max_n, end + 1) + 1):
                last[tuple(tokens[end + 1 - n:end + 1])] = end
        self._indexed = max(self._indexed, upto)

    def start(self, tokens: list[int]) -> None:
        pass  # indexed as drafts are asked for

    def ready(self, tokens: list[int]) -> bool:
        return bool(self.propose(tokens, 1))

    def propose_after(self, history: list[int], nxt: int, limit: int) -> list[int]:
        """`propose(history + [nxt], limit)` without copying the history: a batch row's grows by
        a token a step, and its prompt may be tens of thousands of tokens."""
        size = len(history) + 1
        if limit <= 0 or size < self._min_n + 1:
            return []
        self._index(history, size - 1)
        for n in range(min(self._max_n, size - 1), self._min_n - 1, -1):
            end = self._last.get((*history[size - n:], nxt))
            if end is not None:
                drafts = history[end + 1:end + 1 + limit]
                if end + 1 + limit > len(history):  # the run reaches the token after the history
                    drafts.append(nxt)
                return drafts
        return []

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens to follow `tokens`, or none when its suffix appeared nowhere before."""
        size = len(tokens)
        if limit <= 0 or size < self._min_n + 1:
            return []
        self._index(tokens, size - 1)  # not the last position: the suffix would find itself
        for n in range(min(self._max_n, size - 1), self._min_n - 1, -1):
            end = self._last.get(tuple(tokens[size - n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + limit]
        return []
