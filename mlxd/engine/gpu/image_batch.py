"""Rows with images that start together, prefilled as one batch (Qwen2-VL and Qwen2.5-VL).

A burst of image requests (agents sending screenshots) used to start one row at a time: each
its own vision tower call and its own prefill, the last row's first token waiting for all the
others. Rows that start in the same turn of the batch lane, their images not in the prompt
cache, are prefilled here together instead: one vision tower call over all their images and
one language-model pass over their prompts right-padded to the longest. Under causal masking a
row's tokens never see the padding after them, so each row's KV is what it would be alone
(tests/unit/test_media.py); each is then shifted into lane positions as gpu/media.py does for
a row of its own. Rows of unlike length go in separate batches, so padding stays a small share.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Container
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.gpu import media
from mlxd.engine.gpu.job import Job
from mlxd.engine.gpu.sequence import Sequence
from mlxd.engine.gpu.stats import Stats
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.engine.models.vision import MediaPrompt

log = logging.getLogger("mlxd.engine")
# Tokens in one forward of a batched prefill, in multiples of the prefill step: its columns
# shrink as rows are added, so attention's unfused scores stay bounded.
BATCH_PREFILL_STEPS = 4
# Padding a row may take in a batch: a quarter of the batch's longest prompt, or this many tokens.
PAD_SLACK = 64


def start_batches(loaded: LoadedModel, cache: PrefixCache, seqs: list[Sequence], skip: Container[int], step: int,
                  most: int, stats: Stats, insert: Callable[[Sequence, list[Any], int], None]) -> list[Sequence]:
    """Of `seqs` (started together; those whose id is in `skip` left alone), prefill those that
    can go in batches of up to `most`, and `insert(seq, kv, tokens it holds)` each as a lane
    row; returns the rest in order, to start one by one (a batch that fails is logged and its
    rows are among them)."""
    wanted = [seq for seq in seqs if id(seq) not in skip
              and batchable(loaded, seq.job, cache.longest(media.cache_key(seq.job, seq.job.prompt)))]
    started: set[int] = set()
    for batch in batches([len(seq.job.prompt) for seq in wanted], most) if len(wanted) > 1 else []:
        rows = [wanted[i] for i in batch]
        if len(rows) < 2:
            continue
        for seq in rows:
            seq.start(0)  # their clocks: the batch's prefill is theirs, not queue
        try:
            kvs = start_rows(loaded, [seq.job for seq in rows], step)
        except Exception:
            log.error("a batched image prefill failed; its rows start one by one:\n%s", traceback.format_exc())
            continue
        for seq, (kv, done) in zip(rows, kvs, strict=True):
            insert(seq, kv, done)
            started.add(id(seq))
        stats.image_batches += 1
        stats.image_batch_rows += len(rows)
    return [seq for seq in seqs if id(seq) not in started]


def batchable(loaded: LoadedModel, job: Job, cached: int) -> bool:
    """Whether a row with images may be prefilled in one batch with others (prefill_rows): a
    Qwen2-VL-placed model's image prompt (no video, no audio) whose images the prompt cache
    lacks, and of which it holds at most a quarter (the batch prefills every row from its start)."""
    vlm, prompt = loaded.vlm, job.media
    if vlm is None or prompt is None or getattr(vlm.config, "model_type", None) not in media.QWEN_PLACED:
        return False
    return (set(prompt.arrays) == {"pixel_values", "image_grid_thw"} and bool(prompt.spans)
            and cached <= prompt.spans[0][0] and cached * 4 <= len(job.prompt) and prompt.end < len(job.prompt))


def prefill_rows(loaded: LoadedModel, jobs: list[Job], step: int) -> list[list[Any]]:
    """Each job's prompt but its last token prefilled from its start, the rows as one batch
    (each job `batchable`): the vision tower once over all their images, the language model over
    the prompts right-padded to the longest, `step` x BATCH_PREFILL_STEPS tokens a forward. Under
    causal masking a row's tokens never see the padding after them, so each row's KV is what
    `prefill` would make of it alone. Returns each row's KV, in the model's positions."""
    vlm = loaded.vlm
    assert vlm is not None, "rows with images reach only a vision-language model"
    kv = list(make_prompt_cache(loaded.model))
    if any(type(c) is not KVCache for c in kv):
        raise ValueError("a batched image prefill needs a plain KV cache in every layer")
    ends = [len(job.prompt) - 1 for job in jobs]
    width = max(ends)
    ids = np.empty((len(jobs), width), dtype=np.int64)
    positions = np.empty((3, len(jobs), width), dtype=np.int32)
    merge = int(vlm.config.vision_config.spatial_merge_size)
    for row, (job, end) in enumerate(zip(jobs, ends, strict=True)):
        prompt, placed = job.media, None
        if prompt is not None:
            placed = media.image_positions(prompt.spans, _grids(prompt), merge, len(job.prompt))
        if prompt is None or placed is None:
            raise ValueError("a row in a batched image prefill has no Qwen-VL placing")
        prompt.rope_delta = placed[1]
        ids[row, :end] = job.prompt[:end]
        ids[row, end:] = job.prompt[-1]  # padding: a text token (batchable), never seen by the row's own
        positions[:, row, :end] = placed[0][:, :end]
        positions[:, row, end:] = placed[0][:, end - 1 : end] + 1 + np.arange(width - end)
    tokens = mx.array(ids)
    pixels = mx.concatenate([media.device_array(job.media.arrays["pixel_values"]) for job in jobs])  # type: ignore[union-attr]
    grids = mx.array(np.concatenate([_grids(job.media) for job in jobs if job.media is not None]))
    embeds = vlm.get_input_embeddings(tokens, pixels, image_grid_thw=grids,
                                      mask=mx.ones(tokens.shape, dtype=mx.int32)).inputs_embeds
    placing = mx.array(positions)
    forwards = -(-width * len(jobs) // (step * BATCH_PREFILL_STEPS))
    chunk = -(-width // forwards)
    for a in range(0, width, chunk):
        b = min(a + chunk, width)
        vlm.language_model(tokens[:, a:b], inputs_embeds=embeds[:, a:b], cache=kv, position_ids=placing[..., a:b])
        mx.eval([c.state for c in kv])
    rows = []
    for row, end in enumerate(ends):
        own = []
        for c in kv:
            part = KVCache()
            part.keys, part.values = c.keys[row : row + 1, :, :end], c.values[row : row + 1, :, :end]
            part.offset = end
            own.append(part)
        rows.append(own)
    mx.clear_cache()
    return rows


def start_rows(loaded: LoadedModel, jobs: list[Job], step: int) -> list[tuple[list[Any], int]]:
    """`complete` for rows whose images the prompt cache lacks (each `batchable`), prefilled in
    one batch: each row's KV in lane positions and the tokens of its prompt it holds."""
    out = []
    for job, kv in zip(jobs, prefill_rows(loaded, jobs, step), strict=True):
        delta = job.media.rope_delta if job.media is not None else 0
        out.append((media.shift(kv, -delta, loaded) if delta else kv, len(job.prompt) - 1))
    return out


def batches(lengths: list[int], most: int) -> list[list[int]]:
    """Rows to prefill together, by index: at most `most` a batch, each row padded by at most a
    quarter of its batch's longest or PAD_SLACK tokens (the rest of a batch's width is padding,
    computed for nothing); longest first."""
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        longest = lengths[out[-1][0]] if out else 0
        if out and len(out[-1]) < most and longest - lengths[i] <= max(longest // 4, PAD_SLACK):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _grids(prompt: MediaPrompt) -> np.ndarray:
    return np.asarray(prompt.arrays["image_grid_thw"]).reshape(-1, 3)
