"""The serial lane: one sequence at a time, a token per step, the GPU a token ahead.

The prompt is prefilled a chunk (the solo prefill step: 2048 tokens on a GPU, `--prefill-step`
on the CPU) a step, as generate_step would run it, on its stream, each chunk ending at a
multiple of the chunk size (after a cached prefix the first one is shorter: whole chunks at
aligned positions are the few shapes cuDNN's attention builds once, prefill_attention.py). So
the GPU thread reads its inbox between chunks (a drain, a new job for the batch lane) instead
of after the whole prompt. The prompt's last piece and its first token are one pass
(first_pass.py: generate_step would run the last token alone, a pass more), and the lane then
decodes as generate_step does, one token ahead; the tokens are generate_step's but for the
rounding of that one pass (test_serial_lane.py). A sequence that speculates keeps
generate_step's split (spec/serial.py takes the prompt's last token). A sequence paused for a
more urgent one (its KV to the prompt cache) is taken back the same way, its history as the
prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream, maybe_quantize_kv_cache
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.gpu import first_pass, media, trace
from mlxd.engine.gpu.checkpoints import Checkpoints
from mlxd.engine.gpu.sampling import make_sampling, sampler_args
from mlxd.engine.gpu.sequence import Sequence
from mlxd.engine.gpu.stats import Stats
from mlxd.engine.gpu.step_failure import failed_step
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.engine.spec.accept import Distribution
from mlxd.engine.spec.config import DraftConfig
from mlxd.engine.spec.ngram import NgramDrafter
from mlxd.engine.spec.pace import Rates
from mlxd.engine.spec.serial import Speculator, Tally

log = logging.getLogger("mlxd.engine")
QUANTIZED_KV_START = 0  # --kv-bits quantizes the KV from the first token


class SerialLane:
    """The fastest path for a lone request: generate_step keeps the GPU one token ahead (a Lane)."""

    def __init__(
        self, loaded: LoadedModel, stats: Stats, prefill_step: int, prompt_cache: PrefixCache,
        kv_bits: int | None = None, kv_group_size: int = 64, draft: DraftConfig | None = None,
        checkpoints: Checkpoints | None = None,
    ) -> None:
        self._loaded = loaded
        self._stats = stats
        self._prefill_step = prefill_step
        self._prompt_cache = prompt_cache
        self._kv_bits = kv_bits  # quantize the KV from the first token (mlx-lm's QuantizedKVCache)
        self._kv_group_size = kv_group_size
        self._draft = draft if draft is not None and draft.kind != "none" else None
        self._spec: Speculator | None = None  # the running sequence's decoder when it speculates
        self._rates = Rates()  # drafting against not, as this lane's last speculating rows measured it
        self._checkpoints = checkpoints  # the row's KV to SSD every N tokens (checkpoints.py)
        self._seq: Sequence | None = None
        self._steps: Iterator[tuple[Any, Any]] | None = None  # None while the prompt is prefilled
        self._kv: list[Any] = []
        self._tokens: list[int] = []  # what is prefilled: the prompt, or a resumed sequence's history
        self._done = 0  # of those, the tokens in `_kv` (the cached ones included)
        self._longest_piece = first_pass.longest_piece(loaded.model, prefill_step)
        self._joined = False  # the running sequence's last piece goes with its first token (first_pass.py)

    @property
    def has_work(self) -> bool:
        return self._seq is not None

    @property
    def num_rows(self) -> int:
        return int(self._seq is not None)

    @property
    def num_prefilling(self) -> int:
        return int(self._seq is not None and not self._seq.generated)

    @property
    def most_urgent(self) -> int | None:
        return self._seq.priority if self._seq is not None else None

    def admit(self, seq: Sequence) -> None:
        """Start `seq` (the lane must be free); its prefill runs in the next steps. A paused one
        goes on from its history (its KV from the prompt cache, what of it is still there)."""
        assert self._seq is None, "the serial lane runs one sequence at a time"
        tokens = seq.history
        with trace.part("admit"):
            kv, cached = media.lookup(self._prompt_cache, seq.job, tokens)
        if seq.generated:
            self._stats.num_resumed += 1
        else:
            seq.start(cached)
        with self._loaded.adapters.one(seq.job.adapters):
            kv, done = media.complete(self._loaded, seq.job, tokens, kv, cached, self._prefill_step)
        self._seq, self._tokens, self._done = seq, tokens, done
        self._kv = kv if kv is not None else list(make_prompt_cache(self._loaded.model))
        self._joined = not self._may_speculate(seq)

    def step(self) -> list[Sequence]:
        """One prefill chunk of the running sequence's prompt, or (once prefilled) one token."""
        seq = self._seq
        assert seq is not None
        try:
            if seq.is_cancelled:
                seq.cancel()
            else:
                with self._loaded.adapters.one(seq.job.adapters):  # the passes built here run under its adapters
                    with trace.part("chunk"):
                        prefilled_a_chunk = self._steps is None and self._prefill_chunk(self._tokens)
                    # The prompt's last chunk and its first token in one step: under load a batched
                    # step runs between two of this lane's steps, and the first token need not wait it.
                    if prefilled_a_chunk and not self._prefilled():
                        return []
                    with trace.part("token"):
                        tokens = self._next_tokens()
                if not any(seq.add(token, logprobs) for token, logprobs in tokens):  # stops at the first that ends it
                    if self._checkpoints is not None:
                        with trace.part("checkpoint"):
                            self._checkpoints.serial(seq, self._kv)
                    return []
        except StopIteration:  # generate_step ran out (max_tokens), which `add` has seen
            seq.finish_reason = seq.finish_reason or "length"
        except Exception as exc:
            failed_step(exc, "generation")  # in an engine group it raises: the engine ends
            self._close()
            seq.fail(self._stats, f"generation failed: {type(exc).__name__}: {exc}")
            return [seq]
        with trace.part("store"):
            media.store(self._prompt_cache, self._loaded, seq.job, self._kept_kv(seq), seq.history)
        self._close()
        seq.finish(self._stats)
        return [seq]

    def _kept_kv(self, seq: Sequence) -> list[Any]:
        """The KV to keep for an ended sequence: drafts kept past where it stopped are cut."""
        kv = self._kv
        offset = getattr(kv[0], "offset", None) if kv else None
        if self._spec is not None and isinstance(offset, int) and offset > len(seq.history):
            trim_prompt_cache(kv, offset - len(seq.history))
        return kv

    def _prefilled(self) -> bool:
        """Whether what is left of the prompt is for the first token's pass: its last piece (joined,
        at most one chunk to the next aligned position and the lane's longest piece), else its
        last token (as generate_step leaves it)."""
        left = len(self._tokens) - self._done
        room = self._prefill_step - self._done % self._prefill_step
        return left <= 1 or (self._joined and left <= min(room, self._longest_piece))

    def _prefill_chunk(self, prompt: list[int]) -> bool:
        """Run the next chunk of the prompt, as generate_step's prefill loop would; False when
        what is left is the first token's pass's (_prefilled)."""
        if self._prefilled():
            return False
        left = len(prompt) - self._done - 1
        n = min(self._prefill_step - self._done % self._prefill_step, left)
        with mx.stream(generation_stream):
            self._loaded.model(mx.array(prompt[self._done:self._done + n])[None], cache=self._kv)
            maybe_quantize_kv_cache(self._kv, QUANTIZED_KV_START, self._kv_group_size, self._kv_bits)
            mx.eval([c.state for c in self._kv])
            mx.clear_cache()
        self._done += n
        return True

    def _next_tokens(self) -> list[tuple[int, Any]]:
        if self._spec is not None:
            return self._spec.next_tokens()
        if self._steps is None:
            self._spec = self._speculator()
            if self._spec is not None:
                return self._spec.next_tokens()
            self._steps = self._generate()
        token, logprobs = next(self._steps)
        return [(int(token), logprobs)]

    def _may_speculate(self, seq: Sequence) -> bool:
        """Whether the model drafts and `seq` may speculate (not with images, nor with --kv-bits:
        generate_step quantizes the KV as it grows, the decoder does not)."""
        job = seq.job
        return (self._draft is not None and job.speculate and job.media is None and self._kv_bits is None
                and can_trim_prompt_cache(self._kv))

    def _speculator(self) -> Speculator | None:
        """A speculative decoder for the running sequence, if it may speculate."""
        seq, draft = self._seq, self._draft
        assert seq is not None
        job = seq.job
        if draft is None or not self._may_speculate(seq) or self._done != len(self._tokens) - 1:
            return None
        sampler_kw = sampler_args(job.sampling)
        _, processors = make_sampling(job.sampling, [], job.grammar, sorted(self._loaded.eos_token_ids))
        if seq.tally is None:
            seq.tally = Tally()
        self._steps = iter(())  # the prompt is done: this lane's "decoding" state
        source = self._loaded.drafts  # spec/drafters.py's, opened at load (none: the model-free kind)
        drafter = source.drafter(self._kv) if source is not None else NgramDrafter()
        return Speculator(self._loaded.model, self._kv, list(self._tokens), Distribution(**sampler_kw), processors,
                          drafter, draft.num_draft_tokens, job.max_tokens - len(seq.generated),
                          seed=job.sampling.seed, tally=seq.tally, rates=self._rates, position=seq.position)

    def _generate(self) -> Iterator[tuple[Any, Any]]:
        """The tokens from the prompt's last piece (its KV holds the rest): first_pass.steps
        when the piece is joined with the first token, else generate_step from the last token."""
        seq = self._seq
        assert seq is not None
        job = seq.job
        sampler, processors = make_sampling(job.sampling, self._tokens[:self._done], job.grammar,
                                            sorted(self._loaded.eos_token_ids), seq.position)
        if self._joined:
            return first_pass.steps(self._loaded.model, mx.array(self._tokens[self._done:]), self._kv, sampler,
                                    processors, job.max_tokens - len(seq.generated), self._kv_bits,
                                    self._kv_group_size, QUANTIZED_KV_START)
        return generate_step(
            mx.array(self._tokens[self._done:]),
            self._loaded.model,
            max_tokens=job.max_tokens - len(seq.generated),
            sampler=sampler,
            logits_processors=processors,
            prompt_cache=self._kv,
            prefill_step_size=self._prefill_step,
            kv_bits=self._kv_bits,
            kv_group_size=self._kv_group_size,
            quantized_kv_start=QUANTIZED_KV_START,
        )

    def hand_over(self) -> tuple[Sequence, list[Any]] | None:
        """Give up the running sequence and its KV to the batch lane, if it can move.

        generate_step has fed the last token it yielded and is computing the next; that step
        is dropped (the KV trimmed to before the last token), and the batch lane feeds the last
        token again. A seeded sequence stays: its draws must not depend on when others came.
        """
        seq, kv = self._seq, self._kv
        if seq is None or not self._can_move(seq):
            return None
        if self._spec is not None:
            kv = self._spec.release()
        else:
            trim_prompt_cache(kv, 1)
        self._close()
        return seq, kv

    @property
    def prefilling_prompt(self) -> Any:
        """The running sequence's prompt while it is still being prefilled (no token yet), as
        the prompt cache knows it (media.cache_key), else None."""
        seq = self._seq
        if seq is None or self._steps is not None or seq.generated or seq.is_cancelled or seq.job.media is not None:
            return None
        return media.cache_key(seq.job, seq.job.prompt)

    def hand_over_prefill(self) -> tuple[Sequence, list[Any], int] | None:
        """Give up the running sequence while its prompt is being prefilled: it, its KV so far and
        how many prompt tokens that holds (requests arriving now share the rest of the prefill)."""
        seq, kv, done = self._seq, self._kv, self._done
        if seq is None or self.prefilling_prompt is None:
            return None
        self._close()
        return seq, kv, done

    def _can_move(self, seq: Sequence) -> bool:
        """Generating, unseeded, and its KV in the state we know how to move."""
        if not seq.generated or seq.job.sampling.seed is not None or seq.is_finished:
            return False
        offset = getattr(self._kv[0], "offset", None) if self._kv else None
        if self._spec is not None:
            return offset == len(seq.history) - (not self._spec.queued)
        return offset == len(seq.job.prompt) + len(seq.generated)

    def pausable(self) -> list[Sequence]:
        seq = self._seq
        return [seq] if seq is not None and self._can_move(seq) else []

    def pause(self, seq: Sequence) -> None:
        """Take the running sequence out; its KV (its history but the last token) to the prompt cache."""
        moved = self.hand_over()
        assert moved is not None and moved[0] is seq, "pause only what pausable() gave"
        media.store(self._prompt_cache, self._loaded, seq.job, moved[1], seq.history)

    def fail_all(self, message: str, code: str) -> list[Sequence]:
        """End the running sequence with an error (the lane's state is unknown)."""
        seq = self._seq
        self._close()
        if seq is None:
            return []
        seq.fail(self._stats, message, 500, code)
        return [seq]

    def _close(self) -> None:
        if self._steps is not None:
            close = getattr(self._steps, "close", None)
            if close is not None:
                close()
        self._seq, self._steps, self._kv, self._tokens, self._done = None, None, [], [], 0
        self._spec, self._joined = None, False
