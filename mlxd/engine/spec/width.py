"""How wide a batch's verification pass should be, from what passes cost and what rows keep (pure code).

A batch step with drafts feeds every row its next token and its drafts, padded to the longest:
B rows x (w + 1) positions, where a plain step feeds B x 1. On the 2-core CPU a pass of 8 rows
of SmolLM2 cost 142 ms at one position, 202 at two, 253 at three and 338 at five. So a step
with one row's 4 drafts costs the batch 2.4 plain steps, and pays only when the rows keep
enough drafts among them: a story's few, half-kept drafts lost 5-10% of the batch's speed.

`best_width` picks the width (0: a plain step) that gives the most tokens per unit of cost:
each row's expected kept drafts from its acceptance (a draft j deep is kept with about p^j,
since a refusal ends the run), against the measured cost of a pass that wide relative to a plain
step (`PassCosts`, running means by the number of positions fed). A width never measured is
priced from the widest one measured below it, so wider passes get tried and measured.

The serial lane prices its one row's drafts the same way (`best_width` with one row), its
costs measured per call: a plain token pipelined a pass ahead, against a verification that
waits for its pass (and, for a draft model, drafting included). On the H200 a 4-bit 8B
model's pass of 5 positions cost 3.3 plain steps, so drafts kept 83% of the time there barely
pay at 4 and lose at 1 (docs/benchmarks.md).
"""

from __future__ import annotations

EMA = 0.2  # weight of the newest step in a width's running mean
ACCEPTANCE_START = 0.7  # a new row's acceptance: hopeful, so that it drafts and is measured
ACCEPTANCE_EMA = 0.3  # weight of the newest verification in a row's running acceptance
RETRY_TOKENS = 512  # tokens a lane decodes without a verification before a new row hopes afresh
MAX_RETRY_TOKENS = 16384  # ... doubling each time that hope was not borne out
UNMEASURED_STEP = 0.1  # a pass one position wider than the widest measured: this much more, until measured
STALE = 256  # steps of other widths after which a width's price starts to fall (DECAY)
DECAY = 0.8  # ... its cost beyond a plain step's shrinks by this factor every STALE steps unmeasured
MAX_JUMP = 2.0  # a step at most this many times a width's mean moves it (one slowed by other work)
MAX_FIRST = 4.0  # a width's first step counts at most this many times what it was priced at
# A batch's first pass, before any was measured, in plain steps: on MLX's CUDA backend a pass of
# an 8-row batch of a 4-bit 8B model measured 2.5-3.3 plain steps (H100, H200: docs/benchmarks.md),
# so it is tried only for drafts that would pay even there; elsewhere (the 2-core CPU: 1.42) hopeful.
FIRST_PASS = 1.0 + UNMEASURED_STEP
CUDA_FIRST_PASS = 2.5


class PassCosts:
    """Seconds a batch step takes, by the positions each row fed (1: a plain step).

    A width is measured only when it is chosen, so a mean that one bad moment inflated (a step
    that waited for a prefill chunk, a GPU compiling a new shape) would keep that width from
    ever being chosen again. So a step moves a mean by at most MAX_JUMP times it, a width's
    first step counts at most MAX_FIRST times the price it had, and a width not measured for
    STALE steps gets cheaper (its cost beyond a plain step's shrinks by DECAY every STALE
    steps) until it is chosen and measured again, that step then taken whole (up to MAX_JUMP
    times the old mean). A width once measured costly so stays costly for a while: the
    first form priced a stale width as never measured (one position 0.1 plain steps dearer
    than the one below): on an H100, where a pass of a 4-bit 8B model costs about three plain
    steps, that priced it at 1.1-1.4 again every 256 steps.
    """

    __slots__ = ("_first", "_seconds", "_steps", "_when")

    def __init__(self, first: float = FIRST_PASS) -> None:
        self._first = first  # a pass of 2 positions while none wider than 1 was measured, in plain steps
        self._seconds: dict[int, float] = {}
        self._when: dict[int, int] = {}  # the step each width was last measured at
        self._steps = 0

    def add(self, positions: int, seconds: float) -> None:
        old = self._seconds.get(positions)
        if old is None:
            plain = self._seconds.get(1)
            if positions > 1 and plain is not None:
                seconds = min(seconds, MAX_FIRST * self.relative(positions) * plain)
            self._seconds[positions] = seconds
        elif self._periods(positions):
            self._seconds[positions] = min(seconds, MAX_JUMP * old)
        else:
            self._seconds[positions] = old + EMA * (min(seconds, MAX_JUMP * old) - old)
        self._steps += 1
        self._when[positions] = self._steps

    def _periods(self, positions: int) -> int:
        """Whole STALE spans since the width was last measured (a plain step's never ages)."""
        if positions == 1 or positions not in self._when:
            return 0
        return (self._steps - self._when[positions]) // STALE

    def _price(self, positions: int) -> float | None:
        """A width's seconds as priced now (its mean, fallen with age), None if never measured."""
        seconds = self._seconds.get(positions)
        periods = self._periods(positions)
        if seconds is None or not periods:
            return seconds
        plain = self._seconds.get(1, seconds)
        return plain + (seconds - plain) * DECAY ** periods if seconds > plain else seconds

    def relative(self, positions: int) -> float:
        """A pass of `positions` a row, in plain steps (1.0 while nothing is measured)."""
        plain = self._seconds.get(1)
        if plain is None or plain <= 0:
            return 1.0
        if (seconds := self._price(positions)) is not None:
            return seconds / plain
        below = max((n for n in self._seconds if n < positions), default=1)
        if below == 1:
            return self._first + UNMEASURED_STEP * (positions - 2)
        return self.relative(below) + UNMEASURED_STEP * (positions - below)


def expected_tokens(drafts: int, acceptance: float) -> float:
    """Tokens a row emits from a verification of `drafts` drafts: its kept ones and one more."""
    kept, run = 0.0, 1.0
    for _ in range(drafts):
        run *= acceptance
        kept += run
    return 1.0 + kept


def best_width(lengths: list[int], acceptances: list[float], costs: PassCosts) -> int:
    """The drafts each row checks this step (0: none, a plain step): the width whose tokens per
    unit of cost is the most, `lengths[i]` the drafts row i has, `acceptances[i]` its acceptance."""
    rows = len(lengths)
    best, best_rate = 0, float(rows)  # a plain step: every row one token, for one step's cost
    for width in range(1, max(lengths, default=0) + 1):
        tokens = sum(expected_tokens(min(n, width), p) for n, p in zip(lengths, acceptances, strict=True))
        rate = tokens / costs.relative(width + 1)
        if rate > best_rate:
            best, best_rate = width, rate
    return best


class Guess:
    """A row's n-gram guess made in a plain step (no pass), scored against the tokens the row
    then emits: the acceptance its drafts would have had, for rows that width.py keeps plain."""

    __slots__ = ("seen", "tokens")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.seen = 0  # how many of them came true so far

    @property
    def left(self) -> int:
        """Drafts the guess has after the row's next token (its `seen`-th)."""
        return len(self.tokens) - self.seen - 1

    def score(self, token: int) -> float | None:
        """The row emitted `token`: None while the guess keeps coming true, else the share of it
        that did (the guess is then done)."""
        right = self.tokens[self.seen] == token
        if right and self.seen + 1 < len(self.tokens):
            self.seen += 1
            return None
        return (self.seen + int(right)) / len(self.tokens)


class Hope:
    """A new row's opening acceptance, from what the lane's last rows kept of their drafts.

    Each row used to open at ACCEPTANCE_START, so on a model whose drafts the target never
    keeps (a self-draft of a random model), every request paid a few verifications before its
    acceptance fell below what pays: 4% of a 256-token reply on an H100. A row now opens at the
    acceptance the lane's last rows ended with. A draft model's or a self-draft's row learns its
    acceptance only by drafting (an n-gram row also scores guesses without a pass), so once the
    lane has decoded RETRY_TOKENS with no verification, the next row opens hopeful again and
    drafts; each time such a retry finds nothing worth keeping, the wait doubles (up to
    MAX_RETRY_TOKENS), and a row that keeps drafts at a rate that pays resets it."""

    __slots__ = ("_idle", "_retry", "acceptance")

    def __init__(self) -> None:
        self.acceptance: float | None = None  # the last row's, after its last verification or scored guess
        self._idle = 0  # tokens the lane decoded since
        self._retry = RETRY_TOKENS

    def opening(self) -> float:
        """The acceptance a new row starts from."""
        if self.acceptance is None:
            return ACCEPTANCE_START
        if self.acceptance < ACCEPTANCE_START and self._idle >= self._retry:
            self._idle = 0
            self._retry = min(MAX_RETRY_TOKENS, self._retry * 2)
            return ACCEPTANCE_START
        return self.acceptance

    def kept(self, acceptance: float) -> None:
        """A row's running acceptance after a verification (or a scored n-gram guess)."""
        self.acceptance = acceptance
        self._idle = 0
        if acceptance >= ACCEPTANCE_START:
            self._retry = RETRY_TOKENS

    def plain(self, tokens: int) -> None:
        """The lane decoded `tokens` tokens without checking a draft."""
        self._idle += tokens
