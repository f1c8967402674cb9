"""Rows with images, on the GPU thread: their prompt's prefill from the vision tower's embeddings,
their prompt-cache key, and the rotary shift that lets them decode as text rows.

A row with images starts like any other, from the longest cached prefix of its prompt, but the
prompt cache is asked with `MediaPrompt.key` (each image's tokens replaced by ids from its
content digest): a follow-up question about the same screenshot finds the whole prefix, its
image's KV included, and runs no vision tower at all; another image shares nothing past its
first token. What the cache lacks up to the prompt's last token is prefilled here at once: the
vision tower and the model's embedding of the whole prompt, then the language model from
those embeddings (a chunk at a time). The lane then runs the prompt's last token, as for text.

Qwen-VL models place tokens by multimodal rotary positions: after an image, the text's positions
run `rope_delta` behind the token index. A lane positions its rows by their cache offset
(models/vision.TextView), so a row's keys are rotated by `-rope_delta` when it enters a lane
(RoPE keeps relative positions: the rotated keys hold the same relative positions to each later
query at position `offset` as the originals to one at `offset + rope_delta`) and rotated back
when its KV goes to the prompt cache, which holds every entry in the model's own positions (a
text prompt sharing only the system prompt with it gets keys it can use).
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.gpu.job import Job
from mlxd.engine.models.adapter_bank import namespace
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.engine.models.pixels import PatchedPixels
from mlxd.engine.models.vision import MediaPrompt, uses_mrope


def cache_key(job: Job, tokens: list[int]) -> Any:
    """The prompt cache's key for `tokens` (the job's prompt or history): images by their
    digest (MediaPrompt.key), and under adapters the first token by theirs (so rows under other
    adapters share nothing with it, in the cache or in a shared prefill)."""
    key = job.media.key(tokens) if job.media is not None else tokens
    if job.adapters and len(key):
        key = np.array(key, dtype=np.int64)
        key[0] = namespace(job.adapters, int(key[0]))
    return key


def prompt_key(seq: Any) -> np.ndarray:
    """A Sequence's prompt as the prompt cache and shared prefills know it (`cache_key`)."""
    return np.asarray(cache_key(seq.job, seq.job.prompt), dtype=np.int64)


def lookup(cache: PrefixCache, job: Job, tokens: list[int], min_share: float = 0.0) -> tuple[list[Any] | None, int]:
    """The prompt cache's longest prefix of `tokens` (the job's prompt or history): its KV (None:
    none) and length. A job with images asks by its key, and takes any prefix (`complete` runs
    the rest of its prompt at once, whatever the cache gave)."""
    if job.media is None:
        return cache.fetch(cache_key(job, tokens), min_share=min_share)
    return cache.fetch(cache_key(job, tokens), min_share=0.0)


def complete(loaded: LoadedModel, job: Job, tokens: list[int], kv: list[Any] | None, cached: int,
             prefill_step: int) -> tuple[list[Any] | None, int]:
    """The KV a row starts from, given what `lookup` found, and the tokens of `tokens` it holds.
    A text job's is what the cache gave. A job with images gets its prompt up to its last token
    (all of it, for a resumed history) prefilled here when the cache lacks any of its images,
    and its keys in lane positions."""
    media = job.media
    if media is None:
        return kv, cached
    done = cached
    if done < media.end:
        kv = kv if kv is not None else list(make_prompt_cache(loaded.model))
        end = min(len(job.prompt), len(tokens) - 1)
        prefill(loaded, media, job.prompt, kv, done, end, prefill_step)
        done = end
    delta = rope_delta(loaded, media, job.prompt)
    return (shift(kv, -delta, loaded) if delta and kv is not None else kv), done


def store(cache: PrefixCache, loaded: LoadedModel, job: Job, kv: list[Any], tokens: list[int]) -> None:
    """A row's KV (lane positions) into the prompt cache (the model's positions), under its key."""
    cache.store(in_model_positions(loaded, job, kv), cache_key(job, tokens))


def checkpoint(cache: PrefixCache, loaded: LoadedModel, job: Job, kv: list[Any], tokens: list[int],
               base: Any = None, cached: int = 0) -> Any:
    """A copy of a row's KV to the SSD tier only, under its key (PrefixCache.checkpoint: its Entry)."""
    return cache.checkpoint(in_model_positions(loaded, job, kv), cache_key(job, tokens), base, cached)


def in_model_positions(loaded: LoadedModel, job: Job, kv: list[Any]) -> list[Any]:
    """A row's KV with its keys at the model's positions (a Qwen-VL row's are shifted in the lane)."""
    delta = (job.media.rope_delta or 0) if job.media is not None else 0
    return shift(kv, delta, loaded) if delta else kv


def rope_delta(loaded: LoadedModel, media: MediaPrompt, prompt: list[int]) -> int:
    """How far a Qwen-VL's text positions after the images run from the token index (0 for models
    without multimodal rotary positions); found once per request."""
    if media.rope_delta is None:
        vlm = loaded.vlm
        if vlm is None or not uses_mrope(vlm):
            media.rope_delta = 0
        else:
            _, delta = _positions(vlm, media, prompt)
            media.rope_delta = int(delta)
    return media.rope_delta


# Model types whose images are placed as Qwen2-VL places them (image_positions reproduces it).
QWEN_PLACED = ("qwen2_vl", "qwen2_5_vl")


def _positions(vlm: Any, media: MediaPrompt, prompt: list[int]) -> tuple[mx.array, int]:
    """A Qwen-VL prompt's multimodal positions (3, 1, L) and its rope delta: worked out here for
    Qwen2-VL's placing (mlx-vlm's get_rope_index reads each grid back to the host, a wait per
    value on a GPU), else mlx-vlm's."""
    grid = media.arrays.get("image_grid_thw")
    if getattr(vlm.config, "model_type", None) in QWEN_PLACED and grid is not None and "video_grid_thw" not in media.arrays:
        placed = image_positions(media.spans, np.asarray(grid).reshape(-1, 3),
                                 int(vlm.config.vision_config.spatial_merge_size), len(prompt))
        if placed is not None:
            return mx.array(placed[0])[:, None, :], placed[1]
    return _model_positions(vlm, media, prompt)


def image_positions(spans: list[tuple[int, int]], grids: np.ndarray, merge: int,
                    length: int) -> tuple[np.ndarray, int] | None:
    """Qwen2-VL's positions (3, length) for a prompt whose images take `spans` with `grids` (t, h,
    w patches each, merged `merge` x `merge` into a token), and the rope delta: text runs on one
    position a token; an image's tokens take its time, row and column index from where it
    starts, and the text after it starts past its largest extent. None when a span's length is
    not its grid's tokens (then mlx-vlm's own placing is used)."""
    pos = np.zeros((3, length), dtype=np.int32)
    at = done = 0  # the next position; the tokens placed
    for (start, end), (t, h, w) in zip(spans, grids.tolist(), strict=True):
        hm, wm = h // merge, w // merge
        if end - start != t * hm * wm:
            return None
        pos[:, done:start] = at + np.arange(start - done)
        at += start - done
        pos[0, start:end] = at + np.repeat(np.arange(t), hm * wm)
        pos[1, start:end] = at + np.tile(np.repeat(np.arange(hm), wm), t)
        pos[2, start:end] = at + np.tile(np.arange(wm), t * hm)
        at += max(t, hm, wm)
        done = end
    pos[:, done:] = at + np.arange(length - done)
    return pos, int(at + length - done - length)


def _model_positions(vlm: Any, media: MediaPrompt, prompt: list[int]) -> tuple[mx.array, int]:
    arrays = media.arrays
    grid = arrays.get("image_grid_thw")
    video = arrays.get("video_grid_thw")
    ids = mx.array(prompt)[None]
    positions, delta = vlm.language_model.get_rope_index(
        ids, mx.array(grid) if grid is not None else None, mx.array(video) if video is not None else None,
        mx.ones(ids.shape, dtype=mx.int32),
    )
    return positions, int(mx.array(delta).reshape(-1)[0].item())  # type: ignore[arg-type]


def prefill(loaded: LoadedModel, media: MediaPrompt, prompt: list[int], kv: list[Any], start: int, end: int,
            step: int) -> None:
    """Run `prompt[start:end]` into `kv` from the model's embeddings of the prompt and its images
    and audio (each tower runs once for all of them), `step` tokens at a time: in one go for a
    model whose image tokens see each other (a Gemma 4's bidirectional vision blocks)."""
    vlm = loaded.vlm
    assert vlm is not None, "a job with images reaches only a vision-language model"
    ids = mx.array(prompt)[None]
    extra = {k: device_array(v) for k, v in media.arrays.items() if k != "pixel_values"}
    pixels = media.arrays.get("pixel_values")
    embedded = vlm.get_input_embeddings(ids, device_array(pixels) if pixels is not None else None,
                                        mask=mx.ones(ids.shape, dtype=mx.int32), **extra)
    embeds = embedded.inputs_embeds
    per_layer = getattr(embedded, "per_layer_inputs", None)  # a Gemma 4's, its media tokens' zeroed
    types = extra.get("mm_token_type_ids")
    if types is not None and getattr(vlm.language_model.config, "use_bidirectional_attention", None) == "vision":
        step = max(end - start, 1)
    else:
        types = None
    positions = None
    if uses_mrope(vlm):  # its rope delta comes with it: rope_delta need not work them out again
        positions, media.rope_delta = _positions(vlm, media, prompt)
    for a in range(start, end, step):
        b = min(a + step, end)
        kwargs: dict[str, Any] = {}
        if positions is not None:
            kwargs["position_ids"] = positions[..., a:b]
        if per_layer is not None:
            kwargs["per_layer_inputs"] = per_layer[:, a:b]
        if types is not None:
            kwargs["mm_token_type_ids"] = types[:, a:b]
        vlm.language_model(ids[:, a:b], inputs_embeds=embeds[:, a:b], cache=kv, **kwargs)
        mx.eval([c.state for c in kv])
    mx.clear_cache()


def device_array(value: Any) -> Any:
    """A processor output (models/vision.host_array) on the device: a list stays a list, an
    image's bytes become its patches (models/pixels.py)."""
    if isinstance(value, PatchedPixels):
        return value.build(mx, mx.array)
    return [mx.array(v) for v in value] if isinstance(value, list) else mx.array(value)


def shift(kv: list[Any], delta: int, loaded: LoadedModel) -> list[Any]:
    """A copy of `kv` with every key rotated by `delta` positions (RoPE's rotation of one
    position, `delta` times, in each of the head's frequency pairs); the values are shared."""
    theta = float(getattr(loaded.vlm.language_model.args, "rope_theta", 10000.0))  # type: ignore[union-attr]
    out = []
    for c in kv:
        if type(c) is not KVCache:
            raise ValueError(f"rows with images cannot be moved in a {type(c).__name__}")
        moved = copy.copy(c)
        if c.keys is not None and c.values is not None:
            moved.keys = rotate(c.keys[..., : c.offset, :], delta, theta)
            moved.values = c.values[..., : c.offset, :]
        out.append(moved)
    return out


def rotate(keys: mx.array, delta: int, theta: float) -> mx.array:
    """`keys` (..., head_dim, in the rotate-half layout) turned by RoPE's angle for `delta`
    positions. Written out rather than through mx.fast.rope, whose CUDA kernel refuses a
    negative offset (cudaLaunchKernelExC: invalid argument on the H200)."""
    half = keys.shape[-1] // 2
    angle = delta * mx.power(theta, -mx.arange(half, dtype=mx.float32) * 2 / keys.shape[-1])
    cos, sin = mx.cos(angle), mx.sin(angle)
    x = keys.astype(mx.float32)
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(keys.dtype)
