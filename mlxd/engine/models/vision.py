"""Vision-language models through mlx-vlm: which dirs are one, loading one, and the two faces the
engine serves it through.

mlx-vlm's model is a vision tower, a projector and a language model. The lanes only ever run the
language model on token ids (decode steps, a text prompt's prefill), so a VLM is served through
`TextView`: the language model as an mlx-lm model (logits out, mlx-lm's cache classes), with the
multimodal rotary positions of a Qwen-VL made from each row's cache offset. What images add
is run once per request on the GPU thread before its row starts (gpu/media.py): the vision tower
into the prompt's embeddings, the prompt prefilled from them into the row's KV.

The request side (the templating thread, numpy only): an image's bytes are checked and decoded
with Pillow, the chat template renders the image parts, and the model's processor expands each
into its image tokens and makes the tower's inputs (`MediaPrompt`).

mlx-vlm is the `vision` extra: nothing here imports it until a VLM is loaded.
"""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import xxhash

from mlxd.engine.models.pixels import PatchedPixels
from mlxd.protocol.capabilities import is_vlm_config
from mlxd.protocol.errors import APIError

if TYPE_CHECKING:  # image_memo imports this module
    from mlxd.engine.models.image_memo import PromptMedia

# Past these an image is a 400 before it is decoded (a decompression bomb costs nothing to send).
MAX_IMAGE_PIXELS = 50_000_000
MAX_IMAGES = 32  # per request
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
# Cache-key ids of image tokens (gpu/media.py): above any vocabulary, within the SSD tier's uint32.
KEY_BASE = 0x8000_0000


class VisionExtraMissing(Exception):
    """mlx-vlm is not installed: the message names the extra that brings it."""


def is_vlm_dir(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and is_vlm_config(config, {p.name for p in path.iterdir()})


def import_mlx_vlm() -> Any:
    try:
        import mlx_vlm.utils
    except ImportError as exc:
        raise VisionExtraMissing(
            "this is a vision-language model, served through mlx-vlm, which is not installed: "
            "install mlxd's `vision` extra (pip install 'mlxd[vision]'; `make` installs it)"
        ) from exc
    return mlx_vlm.utils


def load_vlm(path: Path) -> tuple[nn.Module, Any]:
    """mlx-vlm's model (weights lazy: the caller evaluates them) and processor for `path`."""
    utils = import_mlx_vlm()
    model = utils.load_model(path, lazy=True)
    processor = utils.load_processor(path, True, eos_token_ids=getattr(model.config, "eos_token_id", None))
    image_processor = utils.load_image_processor(path)
    if image_processor is not None:
        processor.image_processor = image_processor
    return model, processor


def uses_mrope(vlm: nn.Module) -> bool:
    """Whether the language model places tokens by multimodal rotary positions (a Qwen-VL)."""
    return hasattr(vlm.language_model, "get_rope_index")


class TextView(nn.Module):
    """A VLM's language model as an mlx-lm model: token ids (and a cache) in, logits out.

    With multimodal rotary positions a text token's position is the same in all three sections,
    so each row's positions are its cache offset on (a row with images had its keys shifted to
    make that true: gpu/media.py). mlx-vlm's own code would read positions from state it keeps
    on the model for the last prompt it saw, which rows of a batch cannot share.

    Where one position in all three sections makes the multimodal rotation plain RoPE (a
    Qwen2-VL's and Qwen2.5-VL's language model is a Qwen2), the lanes run mlx-lm's own model of
    that architecture on the same weights (`text_twin`): RoPE in one kernel instead of mlx-vlm's
    cos/sin arithmetic, and the engine's attention routing (gpu/decode_attention.py) for its
    decode steps and prefill chunks, as for any mlx-lm model.
    """

    def __init__(self, vlm: nn.Module) -> None:
        super().__init__()
        self.vlm = vlm
        self._mrope = uses_mrope(vlm)
        self._twin = text_twin(vlm)  # a child (its modules are the model's) but no parameters of its own

    def __call__(self, inputs: mx.array, cache: Any = None, **_: Any) -> mx.array:
        if self._twin is not None:
            return self._twin(inputs, cache=cache)
        lm = self.vlm.language_model
        if not self._mrope:
            return lm(inputs, cache=cache).logits
        batch, length = inputs.shape
        offset = cache[0].offset if cache else 0
        start = offset[:, None] if isinstance(offset, mx.array) and offset.ndim else mx.array(offset).reshape(1, 1)
        positions = mx.broadcast_to(start + mx.arange(length)[None], (batch, length))
        return lm(inputs, cache=cache, position_ids=mx.broadcast_to(positions[None], (3, batch, length))).logits

    @property
    def layers(self) -> Any:
        return self.vlm.language_model.layers

    def make_cache(self) -> list[Any]:
        """mlx-lm's cache classes, layer for layer as the language model makes mlx-vlm's (the
        batch lane merges and splits mlx-lm's)."""
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        lm = self.vlm.language_model
        if not hasattr(lm, "make_cache"):
            return [KVCache() for _ in lm.layers]
        made: list[Any] = []
        for c in lm.make_cache():
            if hasattr(c, "max_size") and type(c).__name__ == "RotatingKVCache":
                made.append(RotatingKVCache(max_size=c.max_size, keep=getattr(c, "keep", 0)))
            elif type(c).__name__ == "KVCache":
                made.append(KVCache())
            else:
                raise ValueError(f"this model's {type(c).__name__} layers are not served yet")
        return made


# mlx-vlm model types whose language model is mlx-lm's Qwen2 but for its multimodal rotation.
QWEN2_TEXT = ("qwen2_vl", "qwen2_5_vl")


def text_twin(vlm: nn.Module) -> nn.Module | None:
    """mlx-lm's Qwen2 on the language model's own weights (shared, not copied: their dtype
    too), quantized as they are, for a Qwen2-VL or Qwen2.5-VL; None for other models, or where
    the two models' parameters do not match name for name and shape for shape."""
    if getattr(vlm.config, "model_type", None) not in QWEN2_TEXT:
        return None
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import qwen2

    text = vlm.config.text_config
    try:
        twin = qwen2.Model(qwen2.ModelArgs(
            model_type="qwen2", hidden_size=text.hidden_size, num_hidden_layers=text.num_hidden_layers,
            intermediate_size=text.intermediate_size, num_attention_heads=text.num_attention_heads,
            rms_norm_eps=text.rms_norm_eps, vocab_size=text.vocab_size, num_key_value_heads=text.num_key_value_heads,
            max_position_embeddings=text.max_position_embeddings or 32768, rope_theta=text.rope_theta,
            rope_traditional=False, rope_scaling=None, tie_word_embeddings=text.tie_word_embeddings))
    except (TypeError, ValueError, AttributeError):
        return None
    lm = vlm.language_model
    quantized = {name: m for name, m in lm.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    if quantized:
        nn.quantize(twin, class_predicate=lambda path, _: (
            {"group_size": q.group_size, "bits": q.bits, "mode": q.mode} if (q := quantized.get(path)) else False))
    flat: Callable[[Any], list[tuple[str, Any]]] = tree_flatten  # type: ignore[assignment]
    weights = {k: v for k, v in flat(lm.parameters()) if ".rotary_emb." not in k}
    wanted = dict(flat(twin.parameters()))
    if wanted.keys() != weights.keys() or any(wanted[k].shape != weights[k].shape for k in wanted):
        return None
    twin.update(tree_unflatten(list(weights.items())))
    return twin


@dataclass(frozen=True, slots=True)
class Image:
    """An image (or audio) part's content: its bytes (as sent), their digest, where the part was
    (for errors), and which kind it is."""

    data: bytes
    digest: bytes = b""
    where: str = "messages"
    kind: str = "image"  # or "audio" (models/audio.py)

    @staticmethod
    def of(data: bytes, where: str = "messages", kind: str = "image") -> Image:
        return Image(data, xxhash.xxh3_128_digest(data), where, kind)


@dataclass(slots=True, eq=False)
class MediaPrompt:
    """A prompt with images, as the GPU thread needs it: the processor's arrays (numpy), where each
    image's tokens are, and (filled on the GPU thread) the rotary shift of its text positions."""

    arrays: dict[str, Any]  # pixel_values, image_grid_thw, ... (numpy; a list of arrays where ragged)
    spans: list[tuple[int, int]]  # [start, end) of each image's tokens in the prompt, in order
    digests: list[bytes]  # each image's content digest, in the same order
    rope_delta: int | None = None  # a Qwen-VL's: text positions after the images run this far from the index
    key_ids: list[np.ndarray] = field(default_factory=list)  # each span's cache-key ids
    request_ms: float = 0.0  # the request's handling before it was queued (its body read, parts decoded, prompt made)

    @property
    def end(self) -> int:
        """The end of the last image's tokens."""
        return self.spans[-1][1] if self.spans else 0

    def key(self, tokens: list[int] | np.ndarray) -> np.ndarray:
        """`tokens` (the prompt, or a history starting with it) with each image's tokens replaced
        by ids from its digest: the prompt cache's key, so that only the same image shares an entry."""
        out = np.asarray(tokens, dtype=np.int64).copy()
        if not self.key_ids:
            for (start, end), digest in zip(self.spans, self.digests, strict=True):
                words = np.frombuffer(digest, dtype="<u4").astype(np.int64) & 0x7FFF_FFFF
                self.key_ids.append(KEY_BASE + np.resize(words, end - start))
        for (start, end), ids in zip(self.spans, self.key_ids, strict=True):
            if start < len(out):
                out[start:end] = ids[: len(out[start:end])]
        return out


def open_image(image: Image, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """The image decoded to RGB with Pillow; a 400 naming the part for what cannot be."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    where = image.where
    try:
        with PILImage.open(io.BytesIO(image.data)) as probe:
            fmt, (width, height) = probe.format, probe.size
            if fmt not in IMAGE_FORMATS:
                raise APIError(400, f"The image in {where} is {fmt}, a format not taken (send PNG, JPEG, WebP, GIF or BMP).",
                               param=where, code="invalid_image")
            if width * height > max_pixels:
                raise APIError(400, f"The image in {where} is {width}x{height} pixels; at most {max_pixels} pixels are taken.",
                               param=where, code="image_too_large")
            probe.seek(0)
            return probe.convert("RGB")
    except APIError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, PILImage.DecompressionBombError) as exc:
        raise APIError(400, f"The image in {where} is not an image mlxd can read ({type(exc).__name__}: {exc}).",
                       param=where, code="invalid_image") from exc


def prepare(processor: Any, text: str, media: PromptMedia, tokens: dict[str, int],
            run: Callable[[Callable[[list[Any]], Any]], Any]) -> tuple[list[int], MediaPrompt]:
    """The processor on the rendered prompt and its images and audio (`media`; `tokens`: the
    token each kind's embeddings take the place of): the prompt's
    token ids (each part's tokens expanded) and what the GPU thread needs for them. `run(call)`
    calls `call(pictures)` with the pictures to give the processor (the image memo's run: the
    decoded images, or stand-ins when it answers for them). Blocking, numpy only."""
    sounds = media.sounds
    try:
        out = run(lambda pictures: processor(text=[text], images=pictures or None, padding=False, return_tensors="np",
                                             **({"audio": sounds} if sounds else {})))
    except APIError:
        raise
    except Exception as exc:  # a processor refusing the prompt or a part is bad input
        raise APIError(400, f"The model's processor could not take the images or audio: {type(exc).__name__}: {exc}",
                       param="messages", code="invalid_image") from exc
    ids = np.asarray(out["input_ids"]).reshape(-1).astype(np.int64)
    arrays = {k: host_array(v) for k, v in out.items() if k not in ("input_ids", "attention_mask", "token_type_ids")}
    kinds = [tokens[item.kind] for item in media.items]
    spans = runs_of(ids, kinds)
    if [int(ids[start]) for start, _ in spans] != kinds:
        raise APIError(400, f"The chat template placed {len(spans)} images and clips in the prompt for "
                            f"{len(media.items)} parts.", param="messages", code="invalid_image")
    return ids.tolist(), MediaPrompt(arrays, spans, [item.digest for item in media.items])


def host_array(value: Any) -> Any:
    """A processor output as numpy: one array, or a list of them where its parts differ in shape
    (a Gemma 4's pixels, each image at its own size)."""
    if isinstance(value, PatchedPixels):  # patched on the GPU thread (pixels.py)
        return value
    try:
        return np.asarray(value)
    except ValueError:
        return [np.asarray(v) for v in value]


def runs_of(ids: np.ndarray, tokens: int | list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of one of `tokens` in `ids` (a run ends where its token changes)."""
    wanted = {tokens} if isinstance(tokens, int) else set(tokens)
    ids = np.asarray(ids)
    hit = np.isin(ids, list(wanted))
    edge = np.flatnonzero(np.diff(np.concatenate([[-1], np.where(hit, ids, -1), [-1]])) != 0)
    return [(int(a), int(b)) for a, b in itertools.pairwise(edge) if hit[a]]
