"""The interface both lanes implement (SerialLane, BatchLane): what the Runner asks of a lane.

A lane runs the sequences it was given, a step at a time on the GPU thread. A sequence whose
client left (its ticket cancelled) ends at the lane's next step; every sequence a lane ends
has been answered through the Sequence (Done or Failed) when `step` or `fail_all` returns it,
so the caller only releases its KV booking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mlxd.engine.gpu.sequence import Sequence


class Lane(Protocol):
    @property
    def has_work(self) -> bool:
        """Whether a step would do anything (rows running or prefilling)."""

    @property
    def num_rows(self) -> int:
        """Sequences the lane holds: what counts against the batch width."""

    @property
    def num_prefilling(self) -> int:
        """Of those, the ones with no token yet (their prompts being prefilled)."""

    @property
    def most_urgent(self) -> int | None:
        """The lowest `priority` among the lane's sequences (None: it holds none)."""

    def admit(self, seq: Sequence) -> None:
        """Take a sequence the scheduler started here; its prefill runs in later steps. One that
        was paused (it has generated tokens) goes on from its history."""

    def step(self) -> list[Sequence]:
        """One step: a token for each generating row and at most one prefill chunk, cancelled
        rows dropped. Returns the sequences that ended, already answered."""

    def pausable(self) -> list[Sequence]:
        """Running sequences that `pause` can take out now, in the order they started."""

    def pause(self, seq: Sequence) -> None:
        """Take a pausable sequence out, its KV (all its history but what the next step would
        run) to the prompt cache; `admit` later goes on where it stopped."""

    def fail_all(self, message: str, code: str) -> list[Sequence]:
        """End every sequence with an error (the lane's state is unknown) and start afresh."""
