"""Rows that end a few steps apart leave the batch together (on a GPU).

mlx-lm drops a row from its generation batch in the step it ends: each layer's keys and values
are gathered into arrays one row smaller, and the rows' padding is read on the host. On an H100
each such shrink of an 8-row batch of an 8B model cost 40-80 ms on top of a 20 ms step, where 8
rows ending in one step empty the batch for nothing (docs/benchmarks.md, issue 27). Rows that
stop at their `max_tokens` end at a step known ahead, and drafts move some of them a few tokens
ahead of the others, so rows started together end a few steps apart, each paying a shrink.

So a row that ends while a live row is due to reach its own `max_tokens` within LINGER_STEPS
steps stays in the batch as a ghost: it is fed and sampled like any row, its tokens are
dropped (the lane no longer knows its uid), it never ends again (its limit and stop matcher
are cleared) and runs no logits processors (a grammar that accepted its end would refuse more).
The ghosts leave in one gather when the batch next shrinks without lingering: when no live row
is due within LINGER_STEPS (a due row that leaves is what lets its ghosts go), when ghosts would
outnumber the live rows (each costs the step a row), or when every live row has ended (the
batch is emptied without a gather). A row about to join flushes them first (`flush`): the
batch lane calls it before it inserts one, so ghosts never hold a place a new row wants.

Only on a GPU: on a CPU a row costs a step its share of the compute and the gather is a cheap
copy in memory (`MLXD_LINGER_ROWS=1` turns it on anywhere, `0` off).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import mlx.core as mx

ENV = "MLXD_LINGER_ROWS"
LINGER_STEPS = 16  # a live row due within this many steps keeps the rows that end meanwhile


class _Never:
    """A stop matcher that never matches (a ghost's: it must not end again)."""

    def advance(self, token: int) -> bool:
        return False


NEVER = _Never()


def enabled() -> bool:
    """On a GPU, unless MLXD_LINGER_ROWS=0; anywhere with MLXD_LINGER_ROWS=1."""
    setting = os.environ.get(ENV, "")
    if setting in ("0", "1"):
        return setting == "1"
    return bool(mx.default_device() == mx.gpu)


def lingering_batch(base: Any) -> Any:
    """A subclass of the generation batch class `base` whose rows linger as this module says."""

    class LingeringBatch(base):
        ghosts: frozenset[int] = frozenset()  # uids of rows that ended and stay, masked
        stats: Any = None  # the engine's (gpu/stats.py): counts the rows that lingered

        def filter(self, keep: list[int]) -> None:
            kept = set(keep)
            live = [i for i in keep if self.uids[i] not in self.ghosts]
            leaving = [i for i in range(len(self.uids)) if i not in kept and self.uids[i] not in self.ghosts]
            ghosts = len(self.ghosts) + len(leaving)
            if not live or ghosts > len(live) or not any(self.max_tokens[i] - self._num_tokens[i] <= LINGER_STEPS
                                                        for i in live):
                self.ghosts = frozenset()
                super().filter(live)
                return
            for i in leaving:
                self.tokens[i] = list(self.tokens[i])  # the list its last answer holds stays as it was
                self.max_tokens[i] = sys.maxsize
                self._matchers[i] = NEVER
                self.logits_processors[i] = []
            self.ghosts = self.ghosts | {self.uids[i] for i in leaving}
            if self.stats is not None:
                self.stats.rows_lingered += len(leaving)

        def extend(self, batch: Any) -> None:
            self.flush()
            super().extend(batch)

        def flush(self) -> None:
            """The ghosts leave now (one gather)."""
            if self.ghosts:
                live = [i for i, uid in enumerate(self.uids) if uid not in self.ghosts]
                self.ghosts = frozenset()
                super().filter(live)

    LingeringBatch.__name__ = f"Lingering{base.__name__}"
    return LingeringBatch


def attach(gen: Any, stats: Any = None) -> bool:
    """Have `gen`'s generation batch keep ended rows as this module says; False where mlx-lm's
    batch has another shape (rows then leave as they end)."""
    steps = getattr(gen, "_generation_batch", None)
    if steps is None or not all(hasattr(steps, a) for a in ("uids", "max_tokens", "_num_tokens", "_matchers",
                                                            "logits_processors", "filter", "extend")):
        return False
    cls = lingering_batch(type(steps))
    cls.stats = stats
    steps.__class__ = cls
    return True


def flush(gen: Any) -> None:
    """Before a row joins `gen`: its generation batch's ghosts leave."""
    steps = getattr(gen, "_generation_batch", None)
    if steps is not None and getattr(steps, "ghosts", None):
        steps.flush()


def ghosts(gen: Any) -> int:
    """Rows lingering in `gen`'s generation batch."""
    return len(getattr(getattr(gen, "_generation_batch", None), "ghosts", ()))
