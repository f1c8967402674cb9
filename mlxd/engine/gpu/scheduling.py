"""Which lane a job takes, and whether its KV cache fits: pure decisions, unit-tested.

The serial lane runs one sequence with mlx-lm's generate_step, the fastest path for a lone
request. The batch lane decodes many rows in one step (continuous batching). A job takes the
serial lane when the engine is otherwise idle and no other job waits with it, and the batch
lane when anything else runs or waits: then it shares each step with the others, and jobs
that arrive together are prefilled together. `--batch 1` keeps to the serial lane.

One exception: a job more urgent than every running one takes the serial lane when it is
free, even while the batch runs. Its prompt is then prefilled alone, between the batch's
steps, and its first token comes from the serial lane's next step, instead of a prefill
beside every decoding row and a batched step after it; once it has a token it joins the
batch (runner.py). So an urgent request's TTFT hardly depends on how many rows decode.

KV admission books each running sequence's worst case (its prompt plus max_tokens, in tokens)
against the engine's budget; a job that does not fit waits, one that could never fit is
refused before it is queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LaneName = Literal["serial", "batch"]


@dataclass(frozen=True, slots=True)
class LaneState:
    """What the lanes hold when a job asks to start."""

    width: int  # --batch: sequences at once, the serial lane's included
    serial_busy: bool
    batch_rows: int
    kv_free: int  # tokens of KV budget not booked by running sequences
    behind: int = 0  # jobs waiting after this one: a burst, prefilled together in the batch lane
    urgent: bool = False  # more urgent than every running job: the free serial lane takes it


def choose_lane(kv_tokens: int, state: LaneState) -> LaneName | None:
    """The lane a job needing `kv_tokens` of KV starts in now, or None: it waits."""
    running = state.serial_busy + state.batch_rows
    if running >= state.width or kv_tokens > state.kv_free:
        return None
    if state.width == 1 or (not state.serial_busy and state.batch_rows == 0 and state.behind == 0):
        return "serial"
    if state.urgent and not state.serial_busy:
        return "serial"
    return "batch"


def kv_tokens(num_prompt: int, max_tokens: int) -> int:
    """The KV a sequence can grow to: its prompt and every token it may generate."""
    return num_prompt + max_tokens


class KvLedger:
    """The engine's KV budget in tokens and what running sequences have booked (GPU thread)."""

    def __init__(self, budget_tokens: int) -> None:
        self.budget_tokens = budget_tokens
        self.booked = 0

    @property
    def free(self) -> int:
        return self.budget_tokens - self.booked

    def can_ever_fit(self, tokens: int) -> bool:
        return tokens <= self.budget_tokens

    def book(self, tokens: int) -> None:
        self.booked += tokens

    def release(self, tokens: int) -> None:
        self.booked = max(0, self.booked - tokens)
