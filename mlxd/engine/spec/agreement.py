"""What an engine group's ranks must decide alike while drafting (docs/distributed.md).

Whether a step drafts, and which drafts it checks, follow the clock and what rank 0's rows
measured (pace.py, width.py): two ranks deciding each on its own would make different model
calls, and a split model's every pass sums across the ranks. So rank 0 decides and sends its
decision with the turn's traffic, and the other ranks take it instead of deciding: `agreed`.
In one engine a decision is just made. n-gram drafts only: a draft model or a self-draft
makes passes of its own, which the other ranks would have to make too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_tell: Callable[[Any], None] | None = None  # rank 0 of a group: send a decision to the others
_hear: Callable[[], Any] | None = None  # another rank: rank 0's next decision


def lead(tell: Callable[[Any], None]) -> None:
    global _tell, _hear
    _tell, _hear = tell, None


def follow(hear: Callable[[], Any]) -> None:
    global _tell, _hear
    _tell, _hear = None, hear


def alone() -> None:
    global _tell, _hear
    _tell = _hear = None


def grouped() -> bool:
    """Whether this engine is a rank of a group (rank 0 or another): a step that raised then
    leaves the ranks out of step, and the engine must end (gpu/step_failure.py)."""
    return _tell is not None or _hear is not None


def agreed(decide: Callable[[], T]) -> T:
    """`decide()`'s value, sent to the group's other ranks (rank 0, or one engine); on another
    rank, rank 0's (lists where rank 0 had tuples), without deciding."""
    if _hear is not None:
        return _hear()
    value = decide()
    if _tell is not None:
        _tell(value)
    return value
