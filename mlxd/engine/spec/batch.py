"""Drafts verified in the batch lane: every row's drafts in one forward pass (GPU thread).

mlx-lm's generation batch keeps each row's next token sampled but not yet fed (`_next_tokens`)
and returns, each step, the tokens it feeds. A step with drafts reads those next tokens on the
host, asks each row that drafts for its drafts (after its history and that token), and runs
one pass over every row's next token followed by its drafts, padded to the longest. Each row
keeps the drafts the target agrees with (accept.py) and takes one token of the target's as its
new next token; a row without drafts rides along with its one token.

Rows keep different numbers of tokens, so each row's KV is rolled back by its own count: what
every row drops is trimmed off the end, and the rest a row drops stays in the buffer as holes
its attention never sees (holes.py), where mlx-lm's own way (`prepare(right_padding=...)` and
`finalize`) would roll every row's whole buffer each step. The step answers with every token
it emitted, in order, several per row; the batch lane takes them one by one.

Only a batch whose caches are all mlx-lm's plain batch cache drafts (no sliding windows, no
recurrent layers, no quantized KV). A row held to a grammar drafts the tokens its grammar
forces, else the drafter's cut where the grammar refuses them; its mask is applied at every
position of the pass (each matcher takes the row's next token and drafts), and the matcher
forgets the drafts the row refused. Every other step is mlx-lm's own (batch_bias.py's, whose
one-op masks feed each matcher the token it feeds the model).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mlxd.engine.chat.grammar import GrammarMask
from mlxd.engine.gpu.sampling import sampler_args
from mlxd.engine.spec.accept import Distribution, accept
from mlxd.engine.spec.agreement import agreed
from mlxd.engine.spec.config import DraftConfig
from mlxd.engine.spec.draft_batch import DraftModelBatch
from mlxd.engine.spec.drafters import greedy_drafts
from mlxd.engine.spec.holes import HoleyKV, punch
from mlxd.engine.spec.ngram import NgramDrafter
from mlxd.engine.spec.pace import Pace
from mlxd.engine.spec.serial import Tally
from mlxd.engine.spec.width import (
    ACCEPTANCE_EMA,
    ACCEPTANCE_START,
    CUDA_FIRST_PASS,
    FIRST_PASS,
    Guess,
    Hope,
    PassCosts,
    best_width,
)

MAX_SKIP = 64  # plain steps at most between drafting steps that keep checking nothing


@dataclass(eq=False)
class RowDrafts:
    """One batch row's drafting: its drafter, pace, distribution and counts."""

    history: Callable[[], list[int]]  # the row's tokens so far, the ones it was answered with (not to be changed)
    dist: Distribution
    pace: Pace
    tally: Tally
    drafter: NgramDrafter = field(default_factory=NgramDrafter)
    acceptance: float = ACCEPTANCE_START  # running share of its drafts kept (width.py prices a pass with it)
    hope: Hope = field(default_factory=Hope)  # the lane's: what its rows kept (a new row opens at it)
    shadow: Guess | None = None  # a plain step's n-gram guess (width.py)
    watched: bool = False  # its last step was plain and watched: `shadow` says what it could draft now

    def could_draft(self) -> int:
        """How many drafts the row could check after its next token, as far as the host knows
        before reading that token: what its standing guess has beyond it (a watched row), else
        its draft length."""
        if not self.watched:
            return self.pace.length
        if self.shadow is None:
            return 0
        return min(self.pace.length, self.shadow.left)

    def watch(self, token: int, limit: int) -> None:
        """The row emitted `token` in a plain step: score the guess it made before (its
        acceptance follows the text without a pass), and guess again from here (n-gram drafts,
        a lookup). A row whose drafts could not pay so keeps a true acceptance, and the batch
        drafts again once they would."""
        if self.shadow is not None:
            if (kept := self.shadow.score(token)) is None:
                return
            self.acceptance += ACCEPTANCE_EMA * (kept - self.acceptance)
            self.hope.kept(self.acceptance)
        guess = self.drafter.propose_after(self.history(), token, limit + 1)
        self.shadow = Guess(guess) if guess else None


class BatchDrafts:
    """The batch lane's drafting rows, by uid (nothing when the model does not draft)."""

    def __init__(self, draft: DraftConfig | None, stats: Any = None, source: Any = None) -> None:
        self._stats = stats  # the engine's (gpu/stats.py): counts the batch's verification passes
        # n-gram drafts, self-drafts (the batch's own first layers, all rows in one pass) and a
        # draft model's (a batch KV of its own: draft_batch.py).
        self.draft = draft if draft is not None and draft.kind in ("ngram", "self", "model") else None
        self._source = source  # spec/drafters.py's DraftSource (a self-draft's cut model)
        self.rows: dict[int, RowDrafts] = {}
        self.hope = Hope()  # what the lane's rows kept of their drafts: where a new row's acceptance opens

    def attach(self, gen: Any, bank: Any, stack_of: Callable[[int], Any]) -> None:
        """Have `gen` verify its rows' drafts, each row under its adapters (adapter_rows.py)."""
        if self.draft is None:
            return
        shallow = drafting = None
        if self.draft.kind != "ngram":
            if self._source is None:
                return
            if self.draft.kind == "self":
                shallow = (self._source.shallow_model(), self.draft.layers)
            else:
                drafting = DraftModelBatch(self._source.draft_model(), self._source.prefill_step)
        attach(gen, self.rows.get, lambda uids: bank.rows([stack_of(uid) for uid in uids]), self._stats, shallow,
               drafting)

    def add(self, uid: int, seq: Any) -> None:
        if self.draft is not None and (drafts := row_drafts_for(seq, self.draft, self.hope)) is not None:
            self.rows[uid] = drafts

    def prune(self, live: Any) -> None:
        """Forget rows no longer in the batch (`live`: the uids that are)."""
        for uid in [uid for uid in self.rows if uid not in live]:
            del self.rows[uid]


def row_drafts_for(seq: Any, draft: DraftConfig, hope: Hope | None = None) -> RowDrafts | None:
    """A batch row's drafting (`seq` a gpu/sequence.py Sequence), if it may draft: not with
    images, nor sampled with a seed (its draws must not depend on the batch)."""
    job = seq.job
    if not job.speculate or job.media is not None:
        return None
    dist = Distribution(**sampler_args(job.sampling))
    if job.sampling.seed is not None and not dist.greedy:
        return None
    if seq.tally is None:
        seq.tally = Tally()  # a row the serial lane handed over keeps its counts
    hope = hope if hope is not None else Hope()
    return RowDrafts(seq.grown_history, dist, Pace(draft.num_draft_tokens, timed=False), seq.tally,
                     acceptance=hope.opening(), hope=hope)


def drafting_batch(base: Any) -> Any:
    """A subclass of the generation batch class `base` whose steps verify drafts."""

    class DraftingBatch(base):
        row_drafts: Callable[[int], RowDrafts | None] = staticmethod(lambda uid: None)
        rows_context: Callable[[list[int]], Any] | None = None  # the adapters' per-row plan (adapter_rows.py)
        stats: Any = None  # the engine's, which counts verification passes
        shallow: tuple[Any, int] | None = None  # a self-draft: the model cut to its first layers, and their count
        draft_batch: DraftModelBatch | None = None  # a draft model's batch KV (draft_batch.py)
        _last_step: tuple[float, dict[int, tuple[RowDrafts, int]], int, int] | None = None  # with positions fed
        other_work: Callable[[], int] = staticmethod(lambda: 0)  # prompt tokens the generator prefilled so far
        _work_seen = 0  # ... at the last step
        _costs: PassCosts | None = None  # what passes cost, by their width (width.py)
        _forced: set[int]  # this step's rows whose drafts their grammar forces (always kept), set by _draft_step
        _skip = 0  # plain steps before drafting may be tried again (after drafting steps that checked nothing)
        _next_skip = 1
        _known_uids: set[int] | None = None  # the rows at the last step (_note_rows)
        _new_rows = 0  # ... of which joined since it last measured afresh
        batch_pace_width = 8  # the batch's width (half its live rows new, at most half of this, means a new batch)
        batch_pace: Pace  # the whole batch's: drafting against not, timed in tokens of all rows
        _next_tokens: Any  # mlx-lm's: the rows' next tokens, sampled and not yet fed
        _next_logprobs: Any
        _current_tokens: Any
        _current_logprobs: Any

        def next(self) -> list[Any]:
            if not self.uids:
                return []
            now = time.perf_counter()
            self._account(now)
            self._note_rows()
            rows = [self.row_drafts(uid) for uid in self.uids]
            if agreed(lambda: not self.batch_pace.drafting or not any(r is not None and r.pace.drafting for r in rows)
                      or not self._plain_rows() or not self._may_pay(rows)):
                out = super().next()
                self._last_step = (now, {r.uid: (d, 1) for r, d in zip(out, rows, strict=False) if d is not None},
                                   self._counted(out), 1)
                self._watch(out, rows)
                return out
            return self._draft_step(now, rows)

        def _counted(self, out: list[Any]) -> int:
            """The step's tokens for the batch's pace: not those of ended rows lingering (gpu/linger.py)."""
            ghosts = getattr(self, "ghosts", ())
            return sum(1 for r in out if r.uid not in ghosts) if ghosts else len(out)

        def _may_pay(self, rows: list[RowDrafts | None]) -> bool:
            """Whether drafts could pay this step if every row drafted its most: reading the rows'
            next tokens on the host (a drafting step's first act) breaks the plain steps'
            pipelining, so a batch whose drafts cannot pay at its rows' acceptance steps plain."""
            if self._skip > 0:
                self._skip -= 1
                return False
            limits, sure = [], []
            for i, rd in enumerate(rows):
                held = grammar_of(self.logits_processors[i]) is not None  # its grammar may force drafts
                if rd is None or not rd.pace.drafting:
                    limits.append(0)
                else:
                    limits.append(rd.pace.length if held else rd.could_draft())
                sure.append(1.0 if held else rd.acceptance if rd is not None else 0.0)
            return best_width(limits, sure, self._costs or new_costs()) > 0

        def _watch(self, out: list[Any], rows: list[RowDrafts | None]) -> None:
            """After a plain step, n-gram rows score and renew their guesses (RowDrafts.watch)."""
            if self.shallow is not None or self.draft_batch is not None:
                return  # a model's guesses cost a pass
            for r, rd in zip(out, rows, strict=False):
                if rd is not None and rd.pace.drafting:
                    rd.watch(r.token, rd.pace.length)
                    rd.watched = True

        def _note_rows(self) -> None:
            """Have the batch's pace measure again once half its rows are new (pace.py's `forget`)."""
            known = self._known_uids or set()
            self._new_rows += sum(1 for uid in self.uids if uid not in known)
            self._known_uids = set(self.uids)
            if self._new_rows * 2 >= min(self.batch_pace_width, max(2, len(self.uids))):
                self.batch_pace.forget()
                self._new_rows = 0

        def _plain_rows(self) -> bool:
            """mlx-lm's plain batch cache in every layer (or that cache with holes: holes.py), not
            sliding windows, recurrent layers or quantized KV."""
            return all(type(c) in (BatchKVCache, HoleyKV) for c in self.prompt_cache)

        def _account(self, now: float) -> None:
            """Time the previous step: the batch's tokens in that time (the rows count down their pauses)."""
            last, self._last_step = self._last_step, None
            work, self._work_seen = self._work_seen, self.other_work()
            if last is None:
                return
            started, counts, total, positions = last
            if self._costs is None:
                self._costs = new_costs()
            if work == self._work_seen:  # a prefill chunk in that time would price the pass with it (attach)
                self._costs.add(positions, now - started)
            for rd, emitted in counts.values():
                rd.pace.spent(emitted, now - started)
                if positions == 1:
                    rd.hope.plain(emitted)
            if counts:  # a step of rows none of which may draft (opted out) says nothing of drafting
                self.batch_pace.spent(total, now - started)

        def _draft_step(self, now: float, rows: list[RowDrafts | None]) -> list[Any]:
            for rd in rows:
                if rd is not None:
                    rd.shadow, rd.watched = None, False  # its tokens from here come from this step, not one at a time
            mx.eval(self._next_tokens)
            nexts: list[int] = [int(t) for t in self._next_tokens.tolist()]
            next_logprobs = list(self._next_logprobs)
            drafts, forced = agreed(lambda: self._choose(rows, nexts))
            self._forced = set(forced)
            width = max(len(d) for d in drafts)
            if width == 0:  # nothing to check, or not enough to pay: mlx-lm's step, from the tokens it already has
                # The host read the rows' tokens for nothing (the pipeline broke): back off 1, 2, 4 ... 64 steps
                self._skip, self._next_skip = self._next_skip, min(MAX_SKIP, self._next_skip * 2)
                if self.stats is not None:
                    self.stats.draft_batch_idle_reads += 1
                self._settle_drafts(rows, [[]] * len(rows))
                out = super().next()
                self._last_step = (now, {r.uid: (d, 1) for r, d in zip(out, rows, strict=False) if d is not None},
                                   self._counted(out), 1)
                return out
            self._next_skip = 1
            inputs = mx.array([[nexts[i], *d, *([nexts[i]] * (width - len(d)))] for i, d in enumerate(drafts)])
            context = self.rows_context(self.uids) if self.rows_context is not None else None
            if context is not None:
                with context:
                    logits = self.model(inputs, cache=self.prompt_cache)
            else:
                logits = self.model(inputs, cache=self.prompt_cache)
            logprobs = self._processed(logits, nexts, drafts)
            if self.stats is not None:
                self.stats.draft_batch_passes += 1
            kept: list[list[int]] = []
            own: dict[int, mx.array] = {}  # rows without drafts: their own sampler, as mlx-lm's step samples them
            for i, d in enumerate(drafts):
                rd = rows[i]
                if d and rd is not None:
                    kept.append(accept(rd.dist, logprobs[i, :len(d) + 1], d))
                    if (grammar := grammar_of(self.logits_processors[i])) is not None:
                        grammar.rollback(len(d) - (len(kept[-1]) - 1))  # it took every draft (_processed)
                else:
                    sampler = (self.samplers[i] if self.samplers else None) or self.fallback_sampler
                    own[i] = sampler(logprobs[i, :1])
                    kept.append([])
            if own:
                mx.eval(list(own.values()))
                for i, token in own.items():
                    kept[i] = [int(token.reshape(-1).tolist()[0])]  # type: ignore[arg-type, index]
            self._roll_back([width - (len(k) - 1) for k in kept])
            self._settle_drafts(rows, [k if d else [] for k, d in zip(kept, drafts, strict=True)])
            return self._answer(now, rows, nexts, next_logprobs, drafts, kept, logprobs)

        def _choose(self, rows: list[RowDrafts | None], nexts: list[int]) -> tuple[list[list[int]], list[int]]:
            """Each row's drafts this step, cut to the width that pays, and the rows whose grammar forces them."""
            limits = []
            for i, rd in enumerate(rows):
                left = self.max_tokens[i] - self._num_tokens[i] - 1  # this step emits the next token at least
                limits.append(0 if rd is None or not rd.pace.drafting or left <= 0 else min(rd.pace.length, left))
            guesses = self._model_drafts(rows, nexts, max(limits)) if any(limits) else None
            self._forced = set()
            drafts = [self._drafts_of(i, rd, nexts[i], limit, g[:limit] if guesses and (g := guesses[i]) is not None else None)
                      if rd is not None and limit else [] for i, (rd, limit) in enumerate(zip(rows, limits, strict=True))]
            for rd, limit, d in zip(rows, limits, drafts, strict=True):
                if rd is not None and limit and not d:
                    rd.pace.found_none()  # three in a row: the row pauses, and a batch of such rows steps plain
            sure = [1.0 if i in self._forced else r.acceptance if r is not None else 0.0 for i, r in enumerate(rows)]
            chosen = best_width([len(d) for d in drafts], sure, self._costs or new_costs())
            return [d[:chosen] for d in drafts], sorted(self._forced)  # a grammar's matcher takes them in _processed

        def _drafts_of(self, i: int, rd: RowDrafts, nxt: int, limit: int, guess: list[int] | None) -> list[int]:
            """Row i's drafts after its next token `nxt` (`guess`: the self-draft's, else the
            n-gram drafter's): under a grammar, the tokens it forces, else the drafts cut where
            the grammar would refuse them (its matcher has taken every token fed so far, so
            `nxt` alone is pending)."""
            grammar = grammar_of(self.logits_processors[i])
            if grammar is not None and not grammar.started:
                return []
            if grammar is not None and (forced := grammar.forced_after([nxt], limit)):
                self._forced.add(i)  # always kept: a pass is priced with them as certain
                return forced
            drafts = guess if guess is not None else rd.drafter.propose_after(rd.history(), nxt, limit)
            return drafts if grammar is None else drafts[:grammar.allowed_after([nxt], drafts)]

        def _model_drafts(self, rows: list[RowDrafts | None], nexts: list[int], count: int) -> list[Any] | None:
            """Each row's greedy guesses from a self-draft or a draft model (None: n-gram drafts)."""
            if self.shallow is not None:
                return self._shallow_drafts(nexts, count)
            if self.draft_batch is None:
                return None
            idx = [i for i, rd in enumerate(rows) if rd is not None]
            histories = [rows[i].history() for i in idx]  # type: ignore[union-attr]
            self.draft_batch.sync([self.uids[i] for i in idx], histories)
            got = self.draft_batch.propose([[*h, nexts[i]] for h, i in zip(histories, idx, strict=True)], count)
            guesses: list[Any] = [None] * len(rows)
            for j, i in enumerate(idx):
                guesses[i] = got[j]
            return guesses

        def _settle_drafts(self, rows: list[RowDrafts | None], kept: list[list[int]]) -> None:
            """A draft model's KV keeps what each row kept of its drafts (draft_batch.py)."""
            if self.draft_batch is not None and self.draft_batch.pending:
                self.draft_batch.settle([max(0, len(kept[i]) - 1) for i, rd in enumerate(rows) if rd is not None])

        def _shallow_drafts(self, nexts: list[int], count: int) -> list[list[int]]:
            """`count` greedy drafts for every row from the model's first layers, in their own
            KV (the batch's, trimmed back after: drafters.py's SelfDrafter, for all rows at once)."""
            assert self.shallow is not None
            model, layers = self.shallow
            kv = self.prompt_cache[:layers]
            context = self.rows_context(self.uids) if self.rows_context is not None else None
            with context if context is not None else contextlib.nullcontext():
                guesses = greedy_drafts(model, kv, mx.array(nexts)[:, None], count)
                mx.eval(guesses)
            for c in kv:
                c.trim(count)
            return guesses.tolist()  # type: ignore[return-value]

        def _processed(self, logits: mx.array, nexts: list[int], drafts: list[list[int]]) -> mx.array:
            """Log probabilities at every position, after each row's processors (which see the
            row's context, its next token and the drafts before each position)."""
            if any(self.logits_processors):
                rows = []
                for i, procs in enumerate(self.logits_processors):
                    if not procs:
                        rows.append(logits[i])
                        continue
                    seen = self._token_context[i].update_and_fetch(mx.array([], dtype=mx.int32))  # fetched, not grown
                    base = mx.concatenate([seen, mx.array([nexts[i]], dtype=seen.dtype)])
                    positions = []
                    for j in range(logits.shape[1]):
                        row = logits[i, j:j + 1]
                        ctx = mx.concatenate([base, mx.array(drafts[i][:j], dtype=base.dtype)]) if j else base
                        for p in procs:
                            row = p(ctx, row)
                        positions.append(row)
                    rows.append(mx.concatenate(positions, axis=0))
                logits = mx.stack(rows)
            return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

        def _roll_back(self, drop: list[int]) -> None:
            """Each row's KV loses its last `drop[i]` entries (the drafts it refused, the padding)."""
            low = min(drop)
            if low:
                for c in self.prompt_cache:
                    c.trim(low)
            punch(self.prompt_cache, [d - low for d in drop])  # the rest: holes (holes.py)

        def _answer(self, now: float, rows: list[RowDrafts | None], nexts: list[int], next_logprobs: list[Any],
                    drafts: list[list[int]], kept: list[list[int]], logprobs: mx.array) -> list[Any]:
            """Emit each row's next token and its kept drafts; the target's last token is its new next."""
            responses: list[Any] = []
            keep: list[int] = []
            counts: dict[int, tuple[RowDrafts, int]] = {}
            for i, uid in enumerate(self.uids):
                accepted = kept[i][:-1]
                emitted = [nexts[i], *accepted]
                emitted_logprobs = [next_logprobs[i], *(logprobs[i, j] for j in range(len(accepted)))]
                self.tokens[i].extend(emitted)
                if self.logits_processors[i]:
                    self._token_context[i].update_and_fetch(mx.array(emitted, dtype=mx.int32))
                rd = rows[i]
                if rd is not None and drafts[i]:
                    rd.tally.proposed += len(drafts[i])
                    rd.tally.accepted += len(accepted)
                    rd.pace.verified(len(drafts[i]), len(accepted))
                    if i not in self._forced:  # a guess's record, not the grammar's
                        rd.acceptance += ACCEPTANCE_EMA * (len(accepted) / len(drafts[i]) - rd.acceptance)
                        rd.hope.kept(rd.acceptance)
                finish = None
                for n, (token, lp) in enumerate(zip(emitted, emitted_logprobs, strict=True)):
                    self._num_tokens[i] += 1
                    if self._num_tokens[i] >= self.max_tokens[i]:
                        finish = "length"
                    if self._matchers[i].advance(token):
                        finish = "stop"
                    if finish is not None:
                        cache = self.extract_cache(i)
                        extra = len(emitted) - n - 1  # kept drafts after the end: not in the answer
                        if extra:
                            for c in cache:
                                c.trim(extra)
                        responses.append(self.Response(uid, token, lp, finish, cache, self.tokens[i][:len(self.tokens[i]) - extra]))
                        break
                    responses.append(self.Response(uid, token, lp, None, None, None))
                if rd is not None:
                    counts[uid] = (rd, len(emitted))
                if finish is None:
                    keep.append(i)
            self._current_tokens = mx.array(nexts, dtype=self._next_tokens.dtype)
            self._current_logprobs = next_logprobs
            self._next_tokens = mx.array([k[-1] for k in kept], dtype=self._next_tokens.dtype)
            self._next_logprobs = [logprobs[i, len(k) - 1] for i, k in enumerate(kept)]
            mx.async_eval(self._next_tokens, self._next_logprobs)
            self._last_step = (now, counts, self._counted(responses), 1 + max(len(d) for d in drafts))
            if len(keep) < len(self.uids):
                self.filter(keep)
            return responses

    DraftingBatch.__name__ = f"Drafting{base.__name__}"
    return DraftingBatch


def new_costs() -> PassCosts:
    """A batch's pass costs, nothing measured yet: priced as a first pass costs on this backend."""
    return PassCosts(CUDA_FIRST_PASS if mx.cuda.is_available() else FIRST_PASS)


def grammar_of(processors: list[Any] | None) -> GrammarMask | None:
    return next((p for p in processors or () if isinstance(p, GrammarMask)), None)


def attach(gen: Any, row_drafts: Callable[[int], RowDrafts | None],
           rows_context: Callable[[list[int]], Any] | None = None, stats: Any = None,
           shallow: tuple[Any, int] | None = None, draft_batch: DraftModelBatch | None = None) -> bool:
    """Have `gen`'s generation batch verify the drafts `row_drafts(uid)` gives its rows."""
    steps = getattr(gen, "_generation_batch", None)
    if steps is None or not all(hasattr(steps, a) for a in ("_next_tokens", "_next_logprobs", "_token_context",
                                                            "_num_tokens", "_matchers", "tokens")):
        return False
    cls = drafting_batch(type(steps))
    cls.row_drafts = staticmethod(row_drafts)
    cls.batch_pace_width = getattr(gen, "completion_batch_size", 8)
    cls.batch_pace = Pace(1, scale=cls.batch_pace_width)
    cls.rows_context = staticmethod(rows_context) if rows_context is not None else None
    cls.stats = stats
    cls.shallow = shallow
    cls.draft_batch = draft_batch
    # mlx-lm's generator prefills a chunk of the prompts it admits after each decoding step; a
    # step's time to the next then holds it, and is not a pass's cost (its counters say when).
    counters = getattr(gen, "_counters", None)
    if counters is not None and hasattr(counters, "prompt_tokens"):
        cls.other_work = staticmethod(lambda: counters.prompt_tokens)
    steps.__class__ = cls
    return True
