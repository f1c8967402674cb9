"""The batch lane: continuous batching with mlx-lm's BatchGenerator.

Rows join and leave between steps. Each step decodes one token for every generating row, then
runs one prefill chunk (`--prefill-step` tokens) of the prompts being admitted: a long prompt
arriving while others decode is prefilled a chunk at a time, and the running rows keep getting
a token every step meanwhile. The choices of one request (n > 1) share a prompt: it is
prefilled once, a chunk a step, and each choice starts as a row from a view of that KV. Per-row sampling, penalties and logit bias are mlx-lm's (rows
with equal parameters share one sampler, so they are sampled in one call; logit biases are
added as one matrix, batch_bias.py); stop strings, EOS and max_tokens are each row's Sequence.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from mlxd.engine.cache.prefix_cache import PrefixCache, view
from mlxd.engine.gpu.batch_bias import batch_bias
from mlxd.engine.gpu.job import PrefillGroup
from mlxd.engine.gpu.sampling import make_sampling
from mlxd.engine.gpu.sequence import Sequence
from mlxd.engine.gpu.stats import Stats
from mlxd.engine.models.loaded_model import LoadedModel

log = logging.getLogger("mlxd.engine")
# Prompts prefilled together in one chunk; more wait for the next chunk.
MAX_PREFILL_ROWS = 8
# Rows prefilled together are padded to the longest, so a cached prefix saves a row little
# and pads every other row by its length: the batch lane uses one only when it covers at least
# this share of the prompt (a short shared preamble made a burst of 8 prefill ~8% slower on
# the 2-core CPU; docs/benchmarks.md). The serial lane uses any.
MIN_CACHED_SHARE = 0.5


class BatchLane:
    """Up to `width` rows decoding together (a Lane)."""

    def __init__(
        self, loaded: LoadedModel, stats: Stats, prefill_step: int, width: int, prompt_cache: PrefixCache
    ) -> None:
        self._loaded = loaded
        self._stats = stats
        self._prefill_step = prefill_step
        self._width = width
        self._prompt_cache = prompt_cache
        self._rows: dict[int, Sequence] = {}
        self._groups: list[PrefillGroup] = []  # shared prompts being prefilled, their choices waiting
        self._gen = self._new_generator()

    def _new_generator(self) -> BatchGenerator:
        gen = BatchGenerator(
            self._loaded.model,
            completion_batch_size=self._width,
            prefill_batch_size=min(self._width, MAX_PREFILL_ROWS),
            prefill_step_size=self._prefill_step,
        )
        batch_bias(gen)
        return gen

    @property
    def has_work(self) -> bool:
        return bool(self._rows or self._groups)

    @property
    def num_rows(self) -> int:
        return len(self._rows) + self._num_grouped()

    @property
    def num_prefilling(self) -> int:
        """Rows with no token yet (their prompts are being prefilled)."""
        return sum(not seq.generated for seq in self._rows.values()) + self._num_grouped()

    def _num_grouped(self) -> int:
        return sum(len(g.waiting) for g in self._groups)

    def admit(self, seq: Sequence) -> None:
        """Queue `seq`'s prompt for prefill; it decodes with the others once prefilled."""
        job = seq.job
        group = job.group
        if group is not None and group.size > 1:
            self._admit_choice(seq, group)
            return
        kv, cached = self._prompt_cache.fetch(job.prompt, min_share=MIN_CACHED_SHARE)
        if kv is None:
            kv = list(make_prompt_cache(self._loaded.model))
        seq.start(cached)
        # The generator's processors see each row's whole history (it is given the cached part).
        sampler, processors = make_sampling(job.sampling, [], job.grammar, sorted(self._loaded.eos_token_ids))
        (uid,) = self._gen.insert(
            [job.prompt[cached:]], max_tokens=[job.max_tokens], caches=[kv], all_tokens=[job.prompt[:cached]],
            samplers=[sampler], logits_processors=[processors],
        )
        self._rows[uid] = seq

    def _admit_choice(self, seq: Sequence, group: PrefillGroup) -> None:
        """A choice of an n > 1 request: it starts from its group's prefill, run once."""
        if group.is_prefilled:
            self._start_choice(seq, group)
            return
        if group.kv is None:
            kv, group.cached = self._prompt_cache.fetch(seq.job.prompt)
            group.kv, group.done = kv if kv is not None else list(make_prompt_cache(self._loaded.model)), group.cached
        group.waiting.append(seq)
        if group not in self._groups:
            self._groups.append(group)

    def _start_choice(self, seq: Sequence, group: PrefillGroup) -> None:
        """Insert a choice as a row whose KV is a view of the group's (its last prompt token to run)."""
        assert group.kv is not None
        job, n = seq.job, group.target
        seq.start(group.cached if not group.inserted else n)  # its clock too: the shared prefill counts as queue
        group.inserted += 1
        sampler, processors = make_sampling(job.sampling, [], job.grammar, sorted(self._loaded.eos_token_ids))
        (uid,) = self._gen.insert(
            [job.prompt[n:]], max_tokens=[job.max_tokens], caches=[view(group.kv, n)], all_tokens=[job.prompt[:n]],
            samplers=[sampler], logits_processors=[processors],
        )
        self._rows[uid] = seq
        if group.inserted >= group.size:
            group.kv = None  # every choice has its view: the group's own cache can go

    def _prefill_groups(self) -> list[Sequence]:
        """Drop choices whose client left; run one prefill chunk of the first group; start the
        choices of a group whose prefill is done. Returns the choices that ended here."""
        ended: list[Sequence] = []
        for group in list(self._groups):
            for seq in [s for s in group.waiting if s.is_cancelled]:
                group.waiting.remove(seq)
                seq.cancel()
                ended.append(seq)
            if not group.waiting:
                self._groups.remove(group)  # its KV so far stays on it for a choice admitted later
        if not self._groups:
            return ended
        group = self._groups[0]
        try:
            if not group.is_prefilled:
                assert group.kv is not None
                end = min(group.done + self._prefill_step, group.target)
                self._loaded.model(mx.array(group.waiting[0].job.prompt[group.done:end])[None], cache=group.kv)
                mx.eval([c.state for c in group.kv])
                group.done = end
            if group.is_prefilled:
                self._groups.remove(group)
                for seq in group.waiting:
                    self._start_choice(seq, group)
                group.waiting.clear()
        except Exception as exc:
            log.error("prefill of a shared prompt failed:\n%s", traceback.format_exc())
            ended += self._fail_group(group, f"generation failed: {type(exc).__name__}: {exc}", "generation_failed")
        return ended

    def _fail_group(self, group: PrefillGroup, message: str, code: str) -> list[Sequence]:
        if group in self._groups:
            self._groups.remove(group)
        failed = list(group.waiting)
        for seq in failed:
            seq.fail(self._stats, message, 500, code)
        group.waiting.clear()
        group.kv = None
        return failed

    def adopt(self, seq: Sequence, kv: list[Any]) -> None:
        """Continue a sequence the serial lane handed over: its KV holds all but its last token."""
        history = seq.history
        # unseeded: a shared sampler; a grammar's matcher goes on where the serial lane left it
        sampler, processors = make_sampling(seq.job.sampling, [], seq.job.grammar, sorted(self._loaded.eos_token_ids))
        (uid,) = self._gen.insert(
            [history[-1:]], max_tokens=[seq.job.max_tokens - len(seq.generated)], caches=[kv],
            all_tokens=[history[:-1]], samplers=[sampler], logits_processors=[processors],
        )
        self._rows[uid] = seq

    def step(self) -> list[Sequence]:
        """Drop cancelled rows, decode one token for each generating row, prefill one chunk."""
        ended = self._drop_cancelled()
        if self._groups:
            ended += self._prefill_groups()
        if self._rows:
            try:
                self._decode(ended)
            except Exception as exc:
                log.error("batched step failed:\n%s", traceback.format_exc())
                ended += self.fail_all(f"generation failed: {type(exc).__name__}: {exc}", "generation_failed")
        for seq in ended:
            if seq.finish_reason != "failed":
                seq.finish(self._stats)
        return ended

    def _decode(self, ended: list[Sequence]) -> None:
        """One generator step; the rows it ends go to `ended` (not yet answered) as they leave."""
        _, responses = self._gen.next()
        leaving: list[int] = []
        kept: list[tuple[list[Any], list[int]]] = []  # the KV of rows that ended, for the prompt cache
        for r in responses:
            seq = self._rows.get(r.uid)
            if seq is None:
                continue
            try:
                is_done = seq.add(int(r.token), getattr(r, "logprobs", None))
            except Exception as exc:  # this row's text handling failed: only this request fails
                log.error("generation failed for one row:\n%s", traceback.format_exc())
                seq.fail(self._stats, f"generation failed: {type(exc).__name__}: {exc}")
                is_done = True
            if r.finish_reason is not None:  # the generator ended it itself (max_tokens) and let it go
                del self._rows[r.uid]
                seq.finish_reason = seq.finish_reason or "length"
                if r.prompt_cache is not None and r.all_tokens is not None and seq.finish_reason != "failed":
                    kept.append((r.prompt_cache, r.all_tokens))
                ended.append(seq)
            elif is_done:
                leaving.append(r.uid)
        if leaving:
            kept += self._remove(leaving, keep_kv=True)
            ended += [self._rows.pop(uid) for uid in leaving]
        for kv, tokens in kept:
            self._prompt_cache.store(kv, tokens)

    def _drop_cancelled(self) -> list[Sequence]:
        """Rows whose client left: out of the generator; their KV so far goes to the prompt
        cache (a client that retries finds it)."""
        gone = [uid for uid, seq in self._rows.items() if seq.is_cancelled]
        if not gone:
            return []
        for kv, tokens in self._remove(gone, keep_kv=True):
            self._prompt_cache.store(kv, tokens)
        ended = [self._rows.pop(uid) for uid in gone]
        for seq in ended:
            seq.cancel()
        return ended

    def _remove(self, uids: list[int], keep_kv: bool = False) -> list[tuple[list[Any], list[int]]]:
        """Take rows out of the generator; with `keep_kv`, the KV and tokens of those that did
        not fail (for the prompt cache)."""
        kept = []
        if keep_kv:
            wanted = [uid for uid in uids if self._rows[uid].finish_reason != "failed"]
            for kv, tokens in self._gen.extract_cache(wanted).values() if wanted else ():
                if kv is not None and tokens is not None:
                    kept.append((kv, tokens))
        self._gen.remove(uids)
        return kept

    def fail_all(self, message: str, code: str) -> list[Sequence]:
        """End every row with an error and start from a fresh generator (its state is unknown)."""
        ended = list(self._rows.values())
        self._rows.clear()
        self._gen = self._new_generator()
        for seq in ended:
            seq.fail(self._stats, message, 500, code)
        for group in list(self._groups):
            ended += self._fail_group(group, message, code)
        return ended
