"""How much one row drafts: its draft length follows its acceptance, and drafting runs only
while it is measured to pay (pure code, no MLX).

- **Length.** It grows by one after a verification that kept every draft and shrinks by one
  after one that kept fewer, between 1 and the configured number.
- **Short pauses.** Three verifications in a row that kept nothing pause drafting for 16
  tokens (32, 64, ... up to 256 while it keeps happening), and so do three drafting steps in
  a row that found nothing to draft (`found_none`: a batch row asked for drafts costs the
  batch a read of its next tokens on the host, which a plain step does not wait for).
- **What the last row learned.** A row may start from `Rates` that its lane keeps for the
  model (`memory`): the regime that was faster for the rows before it runs first, and the
  other is measured again only after EXPLORE tokens, so each new request does not pay for
  measuring both afresh (on a GPU where drafting loses, one window in every lone request).
  That word is about the rows before, not this one: a row that starts plain on it while its
  own n-gram guesses come true (its text repeats where theirs did not: a story, then a JSON
  answer copying its prompt) measures drafting at once (`challenge`) instead of after EXPLORE
  tokens, which is longer than many answers.
- **Drafting against not drafting, measured.** A row's tokens are timed in windows (WINDOW
  tokens drafting, PLAIN_WINDOW tokens plain) as the row really ran: each step of the lane to
  its next, the host's work, the switches between modes and the short pauses included. One
  window of each runs first; then the faster one runs, and the other gets a window again after
  EXPLORE tokens (then 2x, 4x ... up to MAX_EXPLORE as long as it keeps losing), so a change in
  what pays (the context, the batch) is seen. So a row where drafts do not pay, whatever the
  reason (wrong drafts; a GPU whose wider passes cost more than they save), drafts one window
  of 32 tokens after 128 plain ones, then after 256, and so on. A batch is timed as a whole
  (its steps' tokens, with windows and exploring scaled by its width): a row's drafts make
  every row's step wider, so only the batch's rate says whether they pay. Once half its rows
  are new since it last started measuring, it forgets both rates and measures again (`forget`):
  a batch that moved from telling stories to editing code would otherwise wait up to
  MAX_EXPLORE x its width tokens to try drafts again.
"""

from __future__ import annotations

from mlxd.engine.spec.width import Hope, PassCosts

COOLDOWN_TOKENS = 16
MAX_COOLDOWN_TOKENS = 256
EMPTY_RUNS = 3  # verifications in a row that kept nothing
WINDOW = 32  # tokens drafting runs before it is timed (drafts come in bursts)
PLAIN_WINDOW = 8  # tokens plain decoding runs before it is timed (one token a step: steady)
EXPLORE = 128  # tokens of the faster regime before the slower one runs a window again (doubling while it loses)
MAX_EXPLORE = 2048
EMA = 0.5  # weight of the newest window in a regime's running mean

DRAFT, PLAIN = "draft", "plain"


class Rates:
    """Seconds per token of each regime, what passes cost by their width, and what the model's
    last rows kept of their drafts, as they measured them (a lane's)."""

    __slots__ = ("costs", "draft", "hope", "plain")

    def __init__(self) -> None:
        self.draft: float | None = None
        self.plain: float | None = None
        self.costs = PassCosts()
        self.hope = Hope()


class Pace:
    """One row's drafting state."""

    __slots__ = ("_cooldown", "_empty", "_explore", "_exploring", "_measured", "_memory", "_next_cooldown", "_rates",
                 "_scale", "_streak", "_timed", "_window_s", "_window_tokens", "length", "limit", "regime")

    def __init__(self, limit: int, *, scale: int = 1, timed: bool = True, memory: Rates | None = None) -> None:
        """`scale` multiplies the windows and the exploring (a whole batch's tokens: its rows);
        `timed` False: no windows, drafting runs always but for the short pauses (a batch row,
        whose batch times itself); `memory`: the rates the lane's earlier rows measured, read
        now and written as windows close."""
        self._scale = max(1, scale)
        self._timed = timed
        self.limit = max(1, limit)
        self.length = self.limit
        self.regime = DRAFT
        self._rates: dict[str, float | None] = {DRAFT: None, PLAIN: None}  # seconds per token, running means
        self._window_tokens = 0
        self._window_s = 0.0
        self._streak = 0  # tokens the faster regime has made since the other was measured
        self._explore = EXPLORE
        self._exploring = False  # this window runs the slower regime to measure it again
        self._cooldown = 0  # plain tokens left before drafting again (a short pause)
        self._next_cooldown = COOLDOWN_TOKENS
        self._empty = 0
        self._memory = memory
        self._measured: set[str] = set()  # the regimes this row has timed itself
        if memory is not None and memory.draft is not None and memory.plain is not None:
            self._rates = {DRAFT: memory.draft, PLAIN: memory.plain}
            self.regime = DRAFT if memory.draft <= memory.plain else PLAIN

    def forget(self) -> None:
        """Measure both regimes again, drafting first (a batch whose rows have mostly changed:
        what paid for the rows before says little about these)."""
        self.regime = DRAFT
        self._rates = {DRAFT: None, PLAIN: None}
        self._window_tokens, self._window_s = 0, 0.0
        self._streak, self._explore, self._exploring = 0, EXPLORE, False

    @property
    def hearsay(self) -> bool:
        """Plain only because the lane's earlier rows measured drafting slower: this row has not."""
        return self.regime == PLAIN and DRAFT not in self._measured and not self._exploring

    def challenge(self) -> None:
        """The row's own guesses say drafting would pay where the rows before it measured it
        slower: measure a drafting window now (if it loses, the row goes back to plain and
        explores as usual)."""
        if not self.hearsay:
            return
        self._window_tokens, self._window_s = 0, 0.0  # the plain tokens so far do not time drafting
        self._streak, self._exploring, self.regime = 0, True, DRAFT

    @property
    def drafting(self) -> bool:
        return self.regime == DRAFT and self._cooldown == 0

    def rate(self, regime: str) -> float | None:
        """Seconds per token measured for a regime (None: not yet)."""
        return self._rates[regime]

    def spent(self, tokens: int, seconds: float) -> None:
        """The row made `tokens` tokens in `seconds` (one step of the lane to its next)."""
        if tokens <= 0:
            return
        self._cooldown = max(0, self._cooldown - tokens)
        if not self._timed:
            return
        self._window_tokens += tokens
        self._window_s += seconds
        if self._window_tokens >= (WINDOW if self.regime == DRAFT else PLAIN_WINDOW) * self._scale:
            self._close_window()

    def found_none(self) -> None:
        """A drafting step found nothing to draft for the row: three in a row pause it as
        three empty verifications do."""
        self._empty += 1
        if self._empty >= EMPTY_RUNS:
            self._cooldown = self._next_cooldown
            self._next_cooldown = min(MAX_COOLDOWN_TOKENS, self._next_cooldown * 2)
            self._empty = 0

    def verified(self, proposed: int, accepted: int) -> None:
        """A verification of `proposed` drafts kept `accepted` of them (and emitted one more)."""
        self.length = min(self.limit, self.length + 1) if accepted == proposed else max(1, self.length - 1)
        if accepted > 0:
            self._empty = 0
            self._next_cooldown = COOLDOWN_TOKENS
            return
        self._empty += 1
        if self._empty >= EMPTY_RUNS:
            self._cooldown = self._next_cooldown
            self._next_cooldown = min(MAX_COOLDOWN_TOKENS, self._next_cooldown * 2)
            self._empty = 0

    def _close_window(self) -> None:
        regime, per_token, tokens = self.regime, self._window_s / self._window_tokens, self._window_tokens
        old = self._rates[regime]
        self._measured.add(regime)
        self._rates[regime] = per_token if old is None else old + EMA * (per_token - old)
        if self._memory is not None:
            setattr(self._memory, regime, self._rates[regime])
        self._window_tokens, self._window_s = 0, 0.0
        other = PLAIN if regime == DRAFT else DRAFT
        mine, theirs = self._rates[regime], self._rates[other]
        if theirs is None:  # measure the other one next
            self.regime = other
            return
        assert mine is not None
        exploring, self._exploring = self._exploring, False
        if mine <= theirs:
            if exploring:  # the slower one caught up: it leads now
                self._explore = EXPLORE
                self._streak = 0
                return
            self._streak += tokens
            if self._streak >= self._explore * self._scale:  # time to measure the other again
                self._streak = 0
                self._exploring = True
                self.regime = other
        else:
            if exploring:  # it lost again: measured less often from now on
                self._explore = min(MAX_EXPLORE, self._explore * 2)
            else:  # the leader fell behind
                self._explore = EXPLORE
            self._streak = 0
            self.regime = other
