"""The batch lane: continuous batching with mlx-lm's BatchGenerator.

Rows join and leave between steps. Each step decodes one token for every generating row, then
runs one prefill chunk of the prompts being admitted: `--prefill-step` tokens while rows
decode (a long prompt arriving while others decode is prefilled a chunk at a time, and the
running rows keep getting a token every step meanwhile), the solo chunk while none does (2048
on a GPU, where a bigger chunk prefills faster; nobody waits for a token). A prefix several rows share is prefilled once, a chunk a step,
and each of them starts as a row from a view of that KV: the choices of one request (n > 1),
and requests started together whose prompts share a long prefix the prompt cache lacks
(sharing.py says which; one arriving while such a prefill runs joins it). A request the cache
serves as well on its own (a client's next turn, whose previous turn is cached, sharing only
the system prompt with others) starts from its own entry instead. Per-row sampling, penalties and logit bias are mlx-lm's (rows with equal parameters share one sampler, so they
are sampled in one call; logit biases are added as one matrix, batch_bias.py); stop strings,
EOS and max_tokens are each row's Sequence. A row can be paused for a more urgent request (its
KV to the prompt cache) and resumed where it stopped. Rows draft as spec/batch.py says.

Rows whose prefill has just ended get their first token before newer arrivals are prefilled:
mlx-lm's generator samples a prefilled row's first token in the step after its last chunk and
hands it out a step later, and a step that also prefills new prompts hands out nothing until
that prefill is done. So arrivals wait those two steps (`FIRST_TOKEN_STEPS`), and a burst
split by a late few does not give its first part the late part's prefill as time to first
token (on the 2-core CPU: 3.4 s of 9.2; docs/benchmarks.md). One that can join a shared
prefill under way joins it at once; one more urgent than the rows it would wait for starts at once.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from mlxd.engine.cache.kv_layout import view
from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.gpu import adapter_rows, image_batch, linger, media, trace
from mlxd.engine.gpu.batch_bias import batch_bias
from mlxd.engine.gpu.checkpoints import Checkpoints
from mlxd.engine.gpu.job import PrefillGroup
from mlxd.engine.gpu.sampling import make_sampling
from mlxd.engine.gpu.sequence import Sequence
from mlxd.engine.gpu.sharing import MIN_SHARED_TOKENS, clusters, join_target, shareable, uniform_ids
from mlxd.engine.gpu.stats import Stats
from mlxd.engine.gpu.step_failure import after_failed_step, failed_code, failed_row, failed_step
from mlxd.engine.models.adapter_bank import Stack
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.engine.spec.batch import BatchDrafts, DraftConfig

log = logging.getLogger("mlxd.engine")
# Prompts prefilled together in one chunk; more wait for the next chunk.
MAX_PREFILL_ROWS = 8
# Steps arrivals wait once a row's prefill has ended (its first token is sampled, then handed out).
FIRST_TOKEN_STEPS = 2
# Rows prefilled together are padded to the longest, so a cached prefix saves a row little
# and pads every other row by its length: the batch lane uses one only when it covers at least
# this share of the prompt (a short shared preamble made a burst of 8 prefill ~8% slower on
# the 2-core CPU; docs/benchmarks.md). The serial lane uses any; see also sharing.uniform_start.
MIN_CACHED_SHARE = 0.5


class BatchLane:
    """Up to `width` rows decoding together (a Lane)."""

    def __init__(
        self, loaded: LoadedModel, stats: Stats, prefill_step: int, width: int, prompt_cache: PrefixCache,
        solo_step: int | None = None, draft: DraftConfig | None = None, checkpoints: Checkpoints | None = None,
    ) -> None:
        self._loaded = loaded
        self._stats = stats
        self._prefill_step = prefill_step
        self._solo_step = solo_step or prefill_step
        self._width = width
        self._prompt_cache = prompt_cache
        self._rows: dict[int, Sequence] = {}
        self._groups: list[PrefillGroup] = []  # shared prefixes being prefilled, their members waiting
        self._arrivals: list[Sequence] = []  # started this turn: placed together at the next step
        # Sequences the serial lane was prefilling, handed over to share that prefill: id -> (KV, tokens in it)
        self._carried: dict[int, tuple[list[Any], int]] = {}
        self._hold_arrivals = 0  # steps arrivals still wait for just-prefilled rows' first tokens
        self._drafts = BatchDrafts(draft, stats, loaded.drafts)  # rows that draft (spec/batch.py)
        self._checkpoints = checkpoints  # rows' KV to SSD every N tokens (checkpoints.py)
        self._gen = self._new_generator()

    def _new_generator(self) -> BatchGenerator:
        gen = BatchGenerator(self._loaded.model, completion_batch_size=self._width,
                             prefill_batch_size=min(self._width, MAX_PREFILL_ROWS), prefill_step_size=self._prefill_step)
        batch_bias(gen)
        adapter_rows.attach(gen, self._loaded.adapters, self._stack_of)
        _ = linger.enabled() and linger.attach(gen, self._stats)  # rows that end a few steps apart leave together
        self._drafts.attach(gen, self._loaded.adapters, self._stack_of)  # spec/batch.py, last: it wraps the others
        return trace.time_steps(gen)  # its steps timed, with MLXD_TRACE_STEPS only

    def _stack_of(self, uid: int) -> Stack:  # a row's adapters (none for a row that has left)
        return r.job.adapters if (r := self._rows.get(uid)) else ()

    @property
    def has_work(self) -> bool:
        return bool(self._rows or self._groups or self._arrivals)

    @property
    def num_rows(self) -> int:
        return len(self._rows) + self._num_grouped() + len(self._arrivals)

    @property
    def num_prefilling(self) -> int:
        """Rows with no token yet (their prompts are being prefilled)."""
        return sum(not seq.generated for seq in self._rows.values()) + self._num_grouped() + len(self._arrivals)

    @property
    def most_urgent(self) -> int | None:
        held = [*self._rows.values(), *self._arrivals, *(seq for g in self._groups for seq in g.waiting)]
        return min((seq.priority for seq in held), default=None)

    def _num_grouped(self) -> int:
        return sum(len(g.waiting) for g in self._groups)

    def admit(self, seq: Sequence) -> None:
        """Take `seq`: it is placed at the next step, with the others started in the same turn
        (those sharing a long prefix the prompt cache lacks prefill it once), then decodes with
        the others once prefilled. A paused sequence goes on where it stopped."""
        group = seq.job.group
        if group is not None and group.size > 1 and not seq.generated:
            self._admit_choice(seq, group)
            return
        self._arrivals.append(seq)

    @property
    def has_arrivals(self) -> bool:
        return bool(self._arrivals)

    def shares_with_arrivals(self, key: Any) -> bool:
        """Whether a prompt (its cache key: media.cache_key) shares a prefix worth one prefill
        with a request started this turn (more of it than that request's own start would take
        from the prompt cache)."""
        mine = np.asarray(key, dtype=np.int64)
        return any(self._gains(shareable(mine, media.prompt_key(seq)), seq)
                   for seq in self._arrivals if not seq.generated and seq.job.media is None)

    def _own_start(self, seq: Sequence) -> int:
        """The prompt tokens `seq` would take from the prompt cache as a row of its own (_insert)."""
        prompt = seq.job.prompt
        n = self._prompt_cache.longest(media.prompt_key(seq))
        return n if n >= MIN_CACHED_SHARE * len(prompt) else 0

    def _gains(self, shared: int, seq: Sequence) -> bool:
        """Whether starting from a shared prefill of its first `shared` tokens saves `seq` a
        prefill worth sharing over its own start: a client's next turn shares the system prompt
        with others, but its own previous turn in the cache covers more."""
        return shared - self._own_start(seq) >= MIN_SHARED_TOKENS

    def adopt_prefill(self, seq: Sequence, kv: list[Any], done: int) -> None:
        """Take a sequence the serial lane was prefilling (`kv` holds `done` of its prompt's
        tokens): it is placed with this turn's arrivals, and leads the prefill they share."""
        self._carried[id(seq)] = (kv, done)
        self._arrivals.insert(0, seq)

    def _place_arrivals(self) -> list[Sequence]:
        """Start this turn's arrivals: resumed ones as rows, the others into a shared prefill
        under way, a new one, or as rows of their own. Returns those that ended here."""
        arrivals, self._arrivals = self._arrivals, []
        ended: list[Sequence] = []
        fresh: list[Sequence] = []
        singles: list[Sequence] = []
        for seq in arrivals:
            if seq.is_cancelled:
                ended.append(self._cancel_arrival(seq))
            elif seq.generated:
                self._guarded(self._resume, seq, ended)
            elif seq.job.media is not None:
                singles.append(seq)  # prefilled from its images' embeddings: shares no prefill
            elif id(seq) in self._carried or not self._join(seq):
                fresh.append(seq)
        for cluster in clusters([media.prompt_key(s) for s in fresh]):  # rows under other adapters share nothing
            members = [fresh[i] for i in cluster.members]
            singles += self._open_group(members, cluster.shared) if len(members) > 1 else members
        singles = image_batch.start_batches(  # rows with images the cache lacks: prefilled in batches
            self._loaded, self._prompt_cache, singles, self._carried, self._solo_step, MAX_PREFILL_ROWS, self._stats,
            lambda seq, kv, n: self._guarded(lambda s: self._insert_row(s, s.job.prompt, n, kv, s.job.max_tokens), seq, ended))
        uniform = uniform_ids(self._prompt_cache, singles, self._carried, media.prompt_key)
        for seq in singles:
            self._guarded(lambda s: self._insert(s, min_share=0.0 if id(s) in uniform else MIN_CACHED_SHARE), seq,
                          ended)
        return ended

    def _cancel_arrival(self, seq: Sequence) -> Sequence:
        """An arrival whose client left before it was placed: it ends here."""
        self._carried.pop(id(seq), None)
        seq.cancel()
        return seq

    def _join_arrivals(self, waited_for: int) -> list[Sequence]:
        """While arrivals wait for just-prefilled rows' first tokens (the most urgent of those
        rows: `waited_for`): those that can join a shared prefill under way join it now (it runs
        this step anyway, and would be gone two steps on), one more urgent than those rows starts
        now, the cancelled end; the rest keep waiting. Returns those that ended here."""
        waiting: list[Sequence] = []
        ended: list[Sequence] = []
        for seq in self._arrivals:
            if seq.is_cancelled:
                ended.append(self._cancel_arrival(seq))
            elif seq.priority < waited_for:
                self._guarded(self._resume if seq.generated else self._insert, seq, ended)
            elif seq.generated or id(seq) in self._carried or seq.job.media is not None or not self._join(seq):
                waiting.append(seq)
        self._arrivals = waiting
        return ended

    def _guarded(self, start: Any, seq: Sequence, ended: list[Sequence]) -> None:
        """Start one sequence; if that fails, only it fails."""
        try:
            start(seq)
        except Exception as exc:
            failed_step(exc, "starting a request")  # in an engine group it raises: the engine ends
            seq.fail(self._stats, f"generation failed: {type(exc).__name__}: {exc}")
            ended.append(seq)

    def _insert(self, seq: Sequence, min_share: float = MIN_CACHED_SHARE) -> None:
        """A row of its own, from the longest cached prefix of its prompt covering `min_share`
        of it (one the serial lane handed over: from what it had prefilled)."""
        job = seq.job
        if (carried := self._carried.pop(id(seq), None)) is not None:
            self._insert_row(seq, job.prompt, carried[1], carried[0], job.max_tokens)
            return
        kv, cached = media.lookup(self._prompt_cache, job, job.prompt, min_share)
        seq.start(cached)
        with self._loaded.adapters.one(job.adapters):
            kv, done = media.complete(self._loaded, job, job.prompt, kv, cached, self._solo_step)
        self._insert_row(seq, job.prompt, done, kv, job.max_tokens)

    def _insert_row(self, seq: Sequence, tokens: list[int], n: int, kv: list[Any] | None, max_tokens: int) -> None:
        """Into the generator: `kv` holds `tokens[:n]` (None: nothing yet), the rest is prefilled.
        The generator's processors see each row's whole history (it is given the cached part)."""
        job = seq.job
        sampler, processors = make_sampling(job.sampling, [], job.grammar, sorted(self._loaded.eos_token_ids), seq.position)
        linger.flush(self._gen)  # ended rows lingering in the batch leave before a row joins (linger.py)
        (uid,) = self._gen.insert(
            [tokens[n:]], max_tokens=[max_tokens], caches=[kv if kv is not None else self._fresh_cache()],
            all_tokens=[tokens[:n]], samplers=[sampler], logits_processors=[processors],
        )
        self._rows[uid] = seq
        self._drafts.add(uid, seq)

    def _fresh_cache(self) -> list[Any]:
        return list(make_prompt_cache(self._loaded.model))

    def _resume(self, seq: Sequence) -> None:
        """A paused sequence: its history's KV from the prompt cache (what is left), the rest prefilled, then on."""
        history = seq.history
        kv, n = media.lookup(self._prompt_cache, seq.job, history)
        with self._loaded.adapters.one(seq.job.adapters):
            kv, n = media.complete(self._loaded, seq.job, history, kv, n, self._solo_step)
        self._insert_row(seq, history, n, kv, seq.job.max_tokens - len(seq.generated))
        self._stats.num_resumed += 1

    def _open_group(self, members: list[Sequence], shared: int) -> list[Sequence]:
        """A shared prefill of the `shared` tokens `members` start with, for those it saves a
        prefill worth sharing (the prompt cache may already hold as much for them); one the
        serial lane was prefilling leads it, from its KV. Returns the members that start as
        rows of their own (all of them when no group is worth it)."""
        carried = [seq for seq in members if id(seq) in self._carried]
        lead = carried[0] if carried else None
        joining = [seq for seq in members if seq is not lead and self._gains(shared, seq)]
        if len(joining) < (1 if lead is not None else 2):
            return members
        alone = [seq for seq in members if seq is not lead and seq not in joining]
        if lead is not None:
            kv, done = self._carried[id(lead)]
            group = PrefillGroup(0, shared, kv, done, min(lead.cached, done), shared=True)
            joining.insert(0, lead)
        else:
            prefix = media.prompt_key(joining[0])[:shared + 1]  # a fetch leaves one token to run
            if shared - self._prompt_cache.longest(prefix) < MIN_SHARED_TOKENS:
                return members  # the cache holds nearly all of it: too little left to share
            fetched, cached = self._prompt_cache.fetch(prefix)
            group = PrefillGroup(0, shared, fetched if fetched is not None else self._fresh_cache(), cached, cached,
                                 shared=True)
        group.waiting.extend(joining)
        self._groups.append(group)
        self._stats.shared_prefills += 1
        return alone

    def _join(self, seq: Sequence) -> bool:
        """A latecomer joins a shared prefill under way that it shares enough with."""
        prompt = media.prompt_key(seq)
        for group in self._groups:
            if not group.shared or not group.waiting or group.is_prefilled:
                continue
            first = media.prompt_key(group.waiting[0])[:group.target]
            target = join_target(first, group.target, group.done, prompt)
            if target is not None and self._gains(target, seq):
                group.target = target
                group.waiting.append(seq)
                return True
        return False

    def _admit_choice(self, seq: Sequence, group: PrefillGroup) -> None:
        """A choice of an n > 1 request: it starts from its group's prefill, run once."""
        if group.is_prefilled:
            self._start_choice(seq, group)
            return
        if group.kv is None:
            kv, group.cached = media.lookup(self._prompt_cache, seq.job, seq.job.prompt)
            group.kv, group.done = kv if kv is not None else self._fresh_cache(), group.cached
        group.waiting.append(seq)
        if group not in self._groups:
            self._groups.append(group)

    def _start_choice(self, seq: Sequence, group: PrefillGroup) -> None:
        """Start a member as a row whose KV is a view of the group's (the rest of its prompt to run)."""
        assert group.kv is not None
        job, n = seq.job, group.target
        if (carried := self._carried.pop(id(seq), None)) is not None:
            n = max(n, carried[1])  # it started in the serial lane, and may have run past the shared part
        else:
            seq.start(group.cached if not group.inserted else n)  # its clock too: the shared prefill counts as queue
            if group.inserted and group.shared:
                self._stats.shared_tokens += n - group.cached
        group.inserted += 1
        self._insert_row(seq, job.prompt, n, view(group.kv, n), job.max_tokens)
        if group.inserted >= group.size and not group.shared:
            group.kv = None  # every choice has its view: the group's own cache can go

    def _prefill_groups(self) -> list[Sequence]:
        """Drop members whose client left; run one prefill chunk of the first group; start the
        members of a group whose prefill is done. Returns the members that ended here."""
        ended: list[Sequence] = []
        for group in list(self._groups):
            gone = [s for s in group.waiting if s.is_cancelled]
            for seq in gone:
                self._carried.pop(id(seq), None)
                group.waiting.remove(seq)
                seq.cancel()
                ended.append(seq)
            if not group.waiting:
                # Choices keep their KV so far for one admitted later; a shared prefix's goes to
                # the prompt cache (a client that retries finds it).
                self._groups.remove(group)
                if group.shared and gone:
                    self._keep(group, gone[0])
        if not self._groups:
            return ended
        group = self._groups[0]
        try:
            if not group.is_prefilled:
                assert group.kv is not None
                step = self._chunk()
                end = min((group.done // step + 1) * step, group.target)  # chunks end at multiples of it
                lead = group.waiting[0].job
                with self._loaded.adapters.one(lead.adapters):  # its members all run under them
                    self._loaded.model(mx.array(lead.prompt[group.done:end])[None], cache=group.kv)
                mx.eval([c.state for c in group.kv])
                group.done = end
            if group.is_prefilled:
                self._groups.remove(group)
                lead = group.waiting[0]
                for seq in group.waiting:
                    self._start_choice(seq, group)
                group.waiting.clear()
                if group.shared:
                    self._keep(group, lead)
        except Exception as exc:
            failed_step(exc, "prefill of a shared prompt")  # in an engine group it raises
            ended += self._fail_group(group, f"generation failed: {type(exc).__name__}: {exc}", "generation_failed")
        return ended

    def _keep(self, group: PrefillGroup, member: Sequence) -> None:
        """A shared prefix's KV goes to the prompt cache (one arriving later starts from it)."""
        kv, group.kv = group.kv, None
        if kv is not None and group.done > group.cached and len(member.job.prompt) >= group.done:
            self._prompt_cache.store(kv, media.prompt_key(member))

    def _fail_group(self, group: PrefillGroup, message: str, code: str) -> list[Sequence]:
        if group in self._groups:
            self._groups.remove(group)
        failed = list(group.waiting)
        for seq in failed:
            self._carried.pop(id(seq), None)
            seq.fail(self._stats, message, 500, code)
        group.waiting.clear()
        group.kv = None
        return failed

    def adopt(self, seq: Sequence, kv: list[Any]) -> None:
        """Continue a sequence the serial lane handed over: its KV holds all but its last token.
        Unseeded: a shared sampler; a grammar's matcher goes on where the serial lane left it."""
        self._insert_row(seq, seq.history, len(seq.history) - 1, kv, seq.job.max_tokens - len(seq.generated))

    def pausable(self) -> list[Sequence]:
        """Rows that can be paused now: generating, unseeded (a seeded row's draws must not
        depend on when others came), in the order they started."""
        return [seq for seq in self._rows.values() if seq.generated and seq.job.sampling.seed is None]

    def pause(self, seq: Sequence) -> None:
        """Take a generating row out; its KV (its whole history) goes to the prompt cache."""
        uid = next(uid for uid, row in self._rows.items() if row is seq)
        self._remove([uid])
        del self._rows[uid]

    def _chunk(self) -> int:
        """This step's prefill chunk: the fair one while rows decode, else the solo one."""
        return self._prefill_step if any(seq.generated for seq in self._rows.values()) else self._solo_step

    def step(self) -> list[Sequence]:
        """Drop cancelled rows, decode one token for each generating row, prefill one chunk."""
        chunk = self._chunk()
        if self._gen.prefill_step_size != chunk:
            self._gen.prefill_step_size = chunk
            if (prompts := getattr(self._gen, "_prompt_batch", None)) is not None:  # it keeps the step it was made with
                prompts.prefill_step_size = chunk
        ended = self._drop_cancelled()
        holding, self._hold_arrivals = self._hold_arrivals > 0, max(0, self._hold_arrivals - 1)
        if self._arrivals:
            waited_for = min((s.priority for s in self._rows.values() if not s.generated), default=None) if holding else None
            ended += self._place_arrivals() if waited_for is None else self._join_arrivals(waited_for)
        if self._groups:
            ended += self._prefill_groups()
        if self._rows:
            try:
                self._decode(ended)
            except Exception as exc:
                failed_step(exc, "batched step")  # in an engine group it raises: the engine ends
                ended += self.fail_all(f"generation failed: {type(exc).__name__}: {exc}", failed_code(exc))
                after_failed_step(exc)
            if self._checkpoints is not None:
                self._checkpoints.batch(self._gen, self._rows)
        for seq in ended:
            if seq.finish_reason != "failed":
                seq.finish(self._stats)
        return ended

    def _decode(self, ended: list[Sequence]) -> None:
        """One generator step; the rows it ends go to `ended` (not yet answered) as they leave."""
        prompts, responses = self._gen.next()
        if any(not p.end_of_prompt and p.progress[0] == p.progress[1] - 1 for p in prompts):
            self._hold_arrivals = FIRST_TOKEN_STEPS  # a prompt is prefilled but for its last token
        leaving: list[int] = []
        kept: list[tuple[Sequence, list[Any], list[int]]] = []  # the KV of rows that ended, for the prompt cache
        for r in responses:  # a row that kept drafts has several, in order
            seq = self._rows.get(r.uid)
            if seq is None or seq.is_finished or r.uid in leaving:
                continue
            try:
                is_done = seq.add(int(r.token), getattr(r, "logprobs", None))
            except Exception as exc:  # this row's text handling failed: only this request fails
                failed_row(exc)  # (where it says the device is lost, it raises: the engine ends)
                seq.fail(self._stats, f"generation failed: {type(exc).__name__}: {exc}")
                is_done = True
            if r.finish_reason is not None:  # the generator ended it itself (max_tokens) and let it go
                del self._rows[r.uid]
                seq.finish_reason = seq.finish_reason or "length"
                if r.prompt_cache is not None and r.all_tokens is not None and seq.finish_reason != "failed":
                    kept.append((seq, r.prompt_cache, r.all_tokens))
                ended.append(seq)
            elif is_done:
                leaving.append(r.uid)
        if leaving:
            self._remove(leaving)
            ended += [self._rows.pop(uid) for uid in leaving]
        for seq, kv, tokens in kept:
            media.store(self._prompt_cache, self._loaded, seq.job, kv, tokens)
        self._drafts.prune(self._rows)

    def _drop_cancelled(self) -> list[Sequence]:
        """Rows whose client left: out of the generator; their KV so far goes to the prompt
        cache (a client that retries finds it)."""
        gone = [uid for uid, seq in self._rows.items() if seq.is_cancelled]
        if not gone:
            return []
        self._remove(gone)
        ended = [self._rows.pop(uid) for uid in gone]
        for seq in ended:
            seq.cancel()
        return ended

    def _remove(self, uids: list[int]) -> None:
        """Take rows out of the generator; the KV of those that did not fail goes to the prompt
        cache (a row with images under its key, in the model's positions: media.py)."""
        wanted = [uid for uid in uids if self._rows[uid].finish_reason != "failed"]
        for uid, (kv, tokens) in self._gen.extract_cache(wanted).items() if wanted else ():
            if kv is not None and tokens is not None:
                media.store(self._prompt_cache, self._loaded, self._rows[uid].job, kv, tokens)
        self._gen.remove(uids)

    def fail_all(self, message: str, code: str) -> list[Sequence]:
        """End every row with an error and start from a fresh generator (its state is unknown)."""
        ended = list(self._rows.values())
        self._rows.clear()
        self._gen = self._new_generator()
        for seq in ended:
            seq.fail(self._stats, message, 500, code)
        for group in list(self._groups):
            ended += self._fail_group(group, message, code)
        arrivals, self._arrivals = self._arrivals, []
        self._carried.clear()
        for seq in arrivals:
            seq.fail(self._stats, message, 500, code)
        return ended + arrivals
