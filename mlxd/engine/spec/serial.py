"""One row decoding with drafts: the serial lane's speculative decoder (GPU thread).

It replaces mlx-lm's generate_step for a row that speculates, and runs in two modes.

- **Plain**: one token a pass, a pass ahead, as generate_step runs (the next pass is queued
  before the host reads the token it samples from), so a row without drafts loses nothing.
- **Verify**: the row's last token and its drafts go through the model in one pass; the
  row keeps the drafts the target agrees with (accept.py) and one token of the target's, and
  its KV is trimmed back to what it kept.

After each plain token the drafter is asked whether it has something; if so the pass
already queued is taken as the next token and the row verifies from there. A verification
with no drafts falls back to plain steps. pace.py decides how long drafts are and pauses
them while they do not pay; width.py cuts them to the length that pays for its pass, from
what this lane's calls have cost by their width and the row's running acceptance (a row
whose drafts could not pay at any length keeps its plain pipeline unbroken).

Between calls the KV holds every token but the last (`tokens[-1]`), except in plain mode,
where it also holds that one and the next token is being computed (`_ahead`). `release`
brings either to the state the batch lane takes over (generate_step's, after its trim).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import trim_prompt_cache

from mlxd.engine.chat.grammar import GrammarMask
from mlxd.engine.gpu.sampling import token_key
from mlxd.engine.spec.accept import Distribution, accept, as_int
from mlxd.engine.spec.agreement import agreed
from mlxd.engine.spec.drafters import Drafter
from mlxd.engine.spec.ngram import NgramDrafter
from mlxd.engine.spec.pace import Pace, Rates
from mlxd.engine.spec.width import ACCEPTANCE_EMA, Guess, best_width

MAX_SKIP = 64  # plain tokens at most between drains that keep finding nothing to check
Emitted = list[tuple[int, Any]]  # (token, its position's log probabilities over the vocabulary)


class Tally:
    """Drafts proposed and kept, for a request's usage and the engine's stats."""

    __slots__ = ("accepted", "proposed")

    def __init__(self) -> None:
        self.proposed = 0
        self.accepted = 0


class Speculator:
    """Decodes one row whose KV holds all of `tokens` but the last."""

    def __init__(self, model: Any, kv: list[Any], tokens: list[int], dist: Distribution, processors: list[Any],
                 drafter: Drafter, num_draft: int, max_tokens: int, seed: int | None = None,
                 tally: Tally | None = None, rates: Rates | None = None, position: int = 0) -> None:
        self._model = model
        self._kv = kv
        self.tokens = tokens  # the row's history; it grows as tokens are emitted
        self._dist = dist
        self._processors = processors
        self._grammar = next((p for p in processors if isinstance(p, GrammarMask)), None)
        self._drafter = drafter
        self._left = max_tokens  # tokens it may still emit
        # A seeded row draws each token with the key of its place in the reply (gpu/sampling.py):
        # the draws decoding without drafts makes, and the same again after a resume.
        self._seed = seed % 2**64 if seed is not None and not dist.greedy else None
        self._position = position  # the place in the reply of the next token it emits
        self._ctx: mx.array | None = None  # `tokens` on the device, for the processors (_context)
        self.pace = Pace(num_draft, memory=rates)  # `rates`: what the lane's rows before it measured
        rates = rates or Rates()
        self._costs = rates.costs  # the lane's calls' seconds by positions fed (width.py)
        self._hope = rates.hope
        self.acceptance = self._hope.opening()  # running share of this row's (not forced) drafts kept
        self._forced = False  # the drafts being verified are the grammar's own
        self._cheap = isinstance(drafter, NgramDrafter)  # its guesses cost no pass: it guesses while gated off
        self._shadow: Guess | None = None  # gated off: a guess being scored (width.py)
        self._skip = 0  # plain tokens before draining again (after drains that found nothing to check)
        self._next_skip = 1
        self.tally = tally if tally is not None else Tally()
        self._ahead: tuple[mx.array, mx.array] | None = None  # plain mode: the next token, being computed
        self._drain = False  # plain mode: the queued token is the last plain one (drafts next)
        self._last: tuple[float, int, int] | None = None  # the previous call: start, drafts, tokens emitted
        drafter.start(tokens)  # a draft model reads the prompt now, before the row's tokens are timed

    # --- the lane's calls ---

    def next_tokens(self) -> Emitted:
        """The next tokens of the row (one, or more when drafts were kept)."""
        now = time.perf_counter()
        self._account(now)
        if self._ahead is None:
            drafts, forced = agreed(lambda: (self._drafts() if self.pace.drafting else [], self._forced))
            self._forced = bool(forced)
            if not drafts and self._last is not None:  # a drain for nothing: the pipeline broke in vain
                self._skip, self._next_skip = self._next_skip, min(MAX_SKIP, self._next_skip * 2)
            if drafts:
                self._next_skip = 1
                out = self._verify(drafts)
                self._last = (now, len(drafts), len(out))
                self._left -= len(out)
                return out
            context = self._context() if self._processors else None
            self._ahead = self._queue(mx.array(self.tokens[-1:]), context, self._position)
        out = self._plain()
        self._last = (now, 0, len(out))
        self._left -= len(out)
        return out

    def _account(self, now: float) -> None:
        """Time the previous call as the row ran it: from its start to this one's, the lane's
        handling of its tokens included."""
        if self._last is None:
            return
        started, proposed, emitted = self._last
        self._costs.add(proposed + 1, now - started)
        if proposed:
            self.pace.verified(proposed, emitted - 1)
        else:
            self._hope.plain(emitted)
        self.pace.spent(emitted, now - started)

    def release(self) -> list[Any]:
        """Stop decoding; the KV holds all of `tokens` but the last, the grammar's matcher has
        taken all of them (as after generate_step's trim), and the row can move lanes."""
        if self._ahead is not None:
            self._ahead = None
            trim_prompt_cache(self._kv, 1)
        elif self._grammar is not None:
            self._grammar.catch_up(self.tokens)
        return self._kv

    @property
    def kv(self) -> list[Any]:
        return self._kv

    @property
    def queued(self) -> bool:
        """A plain pass is queued: the KV also holds the last token."""
        return self._ahead is not None

    # --- plain steps ---

    def _plain(self) -> Emitted:
        """Emit the queued token; queue the one after it unless drafts take over."""
        assert self._ahead is not None
        token_dev, logprobs = self._ahead
        if self._drain or self._left <= 1:  # verification from here (or the row's last token)
            self._ahead, self._drain = None, False
            mx.eval(token_dev)
            token = as_int(token_dev)
            self.tokens.append(token)
            self._position += 1
            return [(token, logprobs[0])]
        context = self._context(token_dev) if self._processors else None
        self._ahead = self._queue(token_dev, context, self._position + 1)
        mx.async_eval(self._ahead[0])
        token = as_int(token_dev)
        self.tokens.append(token)
        self._position += 1
        self._watch(token)
        if agreed(lambda: self.pace.drafting and self._worth_draining()):
            self._drain = True
        return [(token, logprobs[0])]

    def _worth_draining(self) -> bool:
        """Whether to let the queued pass be the last plain one: a verification follows, so the
        pipeline breaks once. An n-gram row looks at the drafts it would check (a lookup) and
        drains only if they pay; a drafting model is asked only if its full length would.
        Drains that found nothing worth checking (a grammar row's, a model's) back off: 1, 2, 4
        ... up to 64 plain tokens before the next, while they keep finding nothing."""
        if self._skip > 0:
            self._skip -= 1
            return False
        if self._cheap and self._grammar is None:
            guess = self._drafter.propose(self.tokens, self.pace.length)
            return bool(guess) and self._pays(len(guess)) > 0
        return self._pays(self.pace.length) > 0 and self._drafter.ready(self.tokens)

    def _watch(self, token: int) -> None:
        """While no draft pays for its pass, an n-gram row still guesses (no pass: a lookup) and
        checks each guess against the tokens it then emits, so its acceptance follows the text
        and drafting comes back once it would pay. It does the same while it decodes plain only
        on the word of the lane's earlier rows (`Pace.hearsay`): a guess that came true and would
        pay makes it measure drafting now."""
        if self._shadow is not None:
            if (kept := self._shadow.score(token)) is None:
                return
            self.acceptance += ACCEPTANCE_EMA * (kept - self.acceptance)
            self._hope.kept(self.acceptance)
            self._shadow = None
            if kept > 0 and self.pace.hearsay and self._pays(self.pace.length) > 0:
                self.pace.challenge()
        if not self._cheap:
            return
        if (self.pace.drafting and not self._pays(self.pace.length)) or self.pace.hearsay:
            guess = self._drafter.propose(self.tokens, self.pace.length)
            self._shadow = Guess(guess) if guess else None

    def _queue(self, last: mx.array, context: Any, position: int) -> tuple[mx.array, mx.array]:
        """The pass over `last` (one token, maybe still being computed) and the token it samples,
        the reply's token at `position`."""
        with mx.stream(generation_stream):
            logits = self._model(last.reshape(1, 1), cache=self._kv)[:, -1, :]
            for processor in self._processors:
                logits = processor(context, logits)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            token = self._dist.sample(logprobs, self._key(position))
        mx.async_eval(token, logprobs)
        return token, logprobs

    def _context(self, nxt: mx.array | None = None) -> mx.array:
        """The row's tokens (and `nxt`, the one being computed) for its logits processors, kept on
        the device and grown a token a step, as mlx-lm's generate_step keeps them: sent from the
        host's list again only after a verification changed it (a GPU otherwise copied the whole
        history to the device every token). Built on the generation stream, as the passes are: a
        grammar row reads the new token from it early (grammar.py's `read_early`), and on another
        stream that read would wait for the pass queued behind the token too."""
        ctx = self._ctx if self._ctx is not None and self._ctx.size == len(self.tokens) else mx.array(self.tokens)
        if nxt is not None:
            with mx.stream(generation_stream):
                ctx = mx.concatenate([ctx, nxt.astype(ctx.dtype).reshape(-1)])
        self._ctx = ctx
        return ctx

    def _key(self, position: int) -> Any:
        return token_key(self._seed, position) if self._seed is not None else None

    # --- verification ---

    def _pays(self, length: int, acceptance: float | None = None) -> int:
        """The most drafts worth checking of `length` (0: none pays for its pass), at the row's
        acceptance unless given."""
        sure = self.acceptance if acceptance is None else acceptance
        return best_width([length], [sure], self._costs)

    def _drafts(self) -> list[int]:
        limit = min(self.pace.length, self._left - 1)
        if limit <= 0:
            return []
        drafts: list[int] = []
        self._forced = False
        if self._grammar is not None:
            drafts = self._grammar.forced(self.tokens, limit)  # the grammar's own: always right
            self._forced = bool(drafts)
            if drafts:
                return drafts[:self._pays(len(drafts), 1.0)]
        limit = self._pays(limit)  # a draft model drafts only what may pay
        if limit <= 0:
            return []
        drafts = self._drafter.propose(self.tokens, limit)
        if self._grammar is not None and drafts:
            drafts = drafts[:self._grammar.draft_limit(self.tokens, drafts)]
        return drafts[:self._pays(len(drafts))]

    def _verify(self, drafts: list[int]) -> Emitted:
        m = len(drafts)
        self._shadow = None
        with mx.stream(generation_stream):
            logits = self._model(mx.array([self.tokens[-1], *drafts])[None], cache=self._kv)[0]
            if self._processors:
                rows = []
                for j in range(m + 1):
                    row = logits[j:j + 1]
                    ctx = mx.array(self.tokens + drafts[:j])
                    for processor in self._processors:
                        row = processor(ctx, row)
                    rows.append(row)
                logits = mx.concatenate(rows, axis=0)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            keys = [self._key(self._position + j) for j in range(m + 1)] if self._seed is not None else None
            out = accept(self._dist, logprobs, drafts, keys)
        n = len(out) - 1
        if m > n:
            trim_prompt_cache(self._kv, m - n)
            if self._grammar is not None:
                self._grammar.rollback(m - n)
        self.tokens.extend(out)
        self._position += len(out)
        self.tally.proposed += m
        self.tally.accepted += n
        if not self._forced:
            self.acceptance += ACCEPTANCE_EMA * (n / m - self.acceptance)
            self._hope.kept(self.acceptance)
        return [(token, logprobs[j]) for j, token in enumerate(out)]
