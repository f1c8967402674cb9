"""Which prompts starting together share a prefix worth prefilling once: pure decisions, unit-tested.

Subagents, parallel tool calls and `n`-way evaluation harnesses send several requests at once
with one long system prompt (or transcript) that the prompt cache does not hold yet. The batch
lane prefills such a shared prefix once, as one row, and starts each request from a view of its
KV (batch_lane.py); these functions say which requests go together and how far they share.

A prefix is worth sharing from MIN_SHARED_TOKENS on: below that, the extra forward pass of the
shared row costs about what it saves (every chat template starts with a few tokens all requests
share). Prompts are grouped to save the most prefill: sorted, neighbours share their common
prefix, and a run of them either forms one group sharing what all of them share or splits
where they share least, whichever saves more tokens (two groups of agents with different
system prompts are two groups, not one sharing only the template's first tokens). A request
arriving while a shared prefill runs joins it when it shares all of it, or at least half of it
and all that has run. Requests that all find about the same short prefix in the prompt cache
(the chat template's preamble) each start from it (uniform_start).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlxd.engine.cache.ssd_tier import common_prefix

MIN_SHARED_TOKENS = 128
# The least the rows of a turn must all find cached for uniform_start (a chat preamble: 20-40).
MIN_UNIFORM_TOKENS = 16


def shareable(a: np.ndarray, b: np.ndarray) -> int:
    """The tokens `b` can take from a prefill of `a`: their common prefix, leaving at least one
    of `b`'s tokens to run (its logits give the first new token)."""
    return min(common_prefix(a, b), len(b) - 1)


@dataclass(slots=True)
class Cluster:
    """Prompts (by index, in arrival order) that share their first `shared` tokens; a lone
    prompt: `shared` is 0."""

    members: list[int] = field(default_factory=list)
    shared: int = 0

    @property
    def saving(self) -> int:
        """Prompt tokens the group's members do not prefill again."""
        return (len(self.members) - 1) * self.shared


def _order(a: np.ndarray, b: np.ndarray) -> int:
    """Lexicographic order of two token arrays (a shorter prefix first)."""
    n = common_prefix(a, b)
    if n == min(len(a), len(b)):
        return len(a) - len(b)
    return -1 if a[n] < b[n] else 1


def clusters(prompts: Sequence[np.ndarray], min_shared: int = MIN_SHARED_TOKENS) -> list[Cluster]:
    """The prompts grouped by shared prefix (see the module doc), groups in order of their
    first member."""
    if len(prompts) < 2:
        return [Cluster([i], 0) for i in range(len(prompts))]
    def compare(i: int, j: int) -> int:
        return _order(prompts[i], prompts[j])

    order = sorted(range(len(prompts)), key=functools.cmp_to_key(compare))
    # What neighbours share, leaving each at least one token of its own to run.
    near = [min(common_prefix(prompts[i], prompts[j]), len(prompts[i]) - 1, len(prompts[j]) - 1)
            for i, j in itertools.pairwise(order)]

    def best(lo: int, hi: int) -> list[Cluster]:  # order[lo..hi], sharing near[lo..hi-1]
        if lo == hi:
            return [Cluster([order[lo]], 0)]
        cut = min(range(lo, hi), key=lambda k: near[k])
        whole = Cluster(sorted(order[lo:hi + 1]), near[cut])
        parts = best(lo, cut) + best(cut + 1, hi)
        if whole.shared >= min_shared and whole.saving >= sum(c.saving for c in parts):
            return [whole]
        return parts

    return sorted(best(0, len(order) - 1), key=lambda c: c.members[0])


def join_target(group_prefix: np.ndarray, target: int, done: int, prompt: np.ndarray,
                min_shared: int = MIN_SHARED_TOKENS) -> int | None:
    """A latecomer and a shared prefill under way (`done` of its `target` tokens run): the
    group's new target if the prompt joins it (the same, or shorter down to what is already
    run), or None when it does not."""
    n = shareable(group_prefix, prompt)
    if n >= target:
        return target
    if n >= max(done, min_shared) and 2 * n >= target:
        return n
    return None


def uniform_start(found: Sequence[int]) -> bool:
    """Whether rows started together, finding `found` cached tokens each, should all start from
    them though each is under half its prompt: rows prefilled together are padded to the longest
    cached start, so they gain only when each finds about as much (within a quarter of the
    shortest: a word after a chat preamble may match a token more), at least MIN_UNIFORM_TOKENS."""
    if len(found) < 2:
        return False
    shortest = min(found)
    return shortest >= MIN_UNIFORM_TOKENS and max(found) - shortest <= shortest // 4


def uniform_ids(cache: Any, seqs: list[Any], carried: Container[int], key: Callable[[Any], Any]) -> set[int]:
    """The ids of rows started together (Sequences) that may take a cached prefix under half
    their prompt from `cache` (all or none: uniform_start), which knows a row's prompt by
    `key(seq)`. Those carried from the serial lane (their ids in `carried`) and rows with
    images have their own starts."""
    own = [seq for seq in seqs if id(seq) not in carried and seq.job.media is None]
    found = [cache.longest(key(seq)) for seq in own] if len(own) > 1 else []  # a lone row: no scan
    return {id(seq) for seq in own} if uniform_start(found) else set()
