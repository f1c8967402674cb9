"""The batch lane: continuous batching with mlx-lm's BatchGenerator.

Rows join and leave between steps. Each step decodes one token for every generating row, then
runs one prefill chunk (`--prefill-step` tokens) of the prompts being admitted: a long prompt
arriving while others decode is prefilled a chunk at a time, and the running rows keep getting
a token every step meanwhile. Per-row sampling, penalties and logit bias are mlx-lm's (rows
with equal parameters share one sampler, so they are sampled in one call; logit biases are
added as one matrix, batch_bias.py); stop strings, EOS and max_tokens are each row's Sequence.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.gpu.batch_bias import batch_bias
from mlxd.engine.gpu.job import Job
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
    """Up to `width` rows decoding together (the lane interface: see SerialLane)."""

    def __init__(
        self, loaded: LoadedModel, stats: Stats, prefill_step: int, width: int, prompt_cache: PrefixCache
    ) -> None:
        self._loaded = loaded
        self._stats = stats
        self._prefill_step = prefill_step
        self._width = width
        self._prompt_cache = prompt_cache
        self._rows: dict[int, Sequence] = {}
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
        return bool(self._rows)

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    @property
    def num_prefilling(self) -> int:
        """Rows with no token yet (their prompts are being prefilled)."""
        return sum(not seq.generated for seq in self._rows.values())

    def admit(self, job: Job) -> Sequence:
        """Queue `job`'s prompt for prefill; it decodes with the others once prefilled."""
        kv, cached = self._prompt_cache.fetch(job.prompt, min_share=MIN_CACHED_SHARE)
        if kv is None:
            kv = list(make_prompt_cache(self._loaded.model))
        seq = Sequence(job, self._loaded.tokenizer, self._loaded.eos_token_ids, cached)
        # The generator's processors see each row's whole history (it is given the cached part).
        sampler, processors = make_sampling(job.sampling, [], job.grammar, sorted(self._loaded.eos_token_ids))
        (uid,) = self._gen.insert(
            [job.prompt[cached:]], max_tokens=[job.max_tokens], caches=[kv], all_tokens=[job.prompt[:cached]],
            samplers=[sampler], logits_processors=[processors],
        )
        self._rows[uid] = seq
        return seq

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
        return ended
