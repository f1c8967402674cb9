"""What the model's processor made of recently seen images, so that the same images again (a
follow-up question about one screenshot, an agent sending its conversation again) are neither
base64-decoded, nor decoded by Pillow, nor resized and normalised again.

A request's images are looked up by what was sent: a digest of each image part's data URI, all of
them in order. An entry holds the images' content digests (the prompt cache's key, gpu/media.py)
and the processor's image outputs (`pixel_values`, grids, ...). On a hit the processor still
renders the prompt's text, its image placeholders expanded, but the image processor inside it
hands back the entry's outputs for stand-in pictures.

Whether a processor can be served that way is checked once, on the first images it sees: the
stand-ins run beside the real pictures and must give the same token ids and the same arrays. A
processor that reads the pictures anywhere but through its image processor fails the check, and
its model is never served from the memo.

`read_media` reads a request's image and audio parts into a `PromptMedia` (on the engine's
image-decoding threads), from the memo when it can; the memo's `run` wraps the processor's call
(on the templating thread, one request at a time). Once a first request has shown how the
processor calls its image processor (and that call, given the real pictures, gave the same
answer), new images are resized and normalised on the decoding threads too, several requests
at once, and the templating thread only renders their text: the image processor's numpy work
(about 60 ms for an 896x896 Qwen-VL image on the H200's host) no longer queues requests one
behind another. A prompt with audio is decoded whole, and not kept. Blocking, numpy only.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from mlxd.engine.models.audio import open_audio
from mlxd.engine.models.pixels import make_patcher
from mlxd.engine.models.vision import Image, open_image
from mlxd.protocol.media import AudioPart, ImagePart

MAX_BYTES = 256 << 20  # the processors' arrays held, at most
MAX_ENTRIES = 64


def source_key(uris: Sequence[str]) -> bytes:
    """The memo's key for a request's image parts: a digest of each part as sent, in order."""
    h = xxhash.xxh3_128()
    for uri in uris:
        h.update(xxhash.xxh3_128_digest(uri.encode("utf-8", "surrogatepass")))
    return h.digest()


@dataclass(frozen=True, slots=True)
class Seen:
    digests: tuple[bytes, ...]  # each image's content digest (vision.Image.digest), in order
    outputs: Any  # the image processor's answer for these images (a BatchFeature or dict)
    nbytes: int
    fresh: bool = False  # made for this request (ImageMemo.process), not yet kept


@dataclass(frozen=True, slots=True)
class PromptMedia:
    """A prompt's images and audio clips as the processor takes them: decoded (`pictures`,
    `sounds`), or the images seen lately (`seen`: then `pictures` is None)."""

    items: list[Image]  # each image and clip, in the prompt's order (Image.kind says which)
    pictures: list[Any] | None  # each image decoded (Pillow, RGB); None when `seen` answers for them
    sounds: list[np.ndarray] = field(default_factory=list)  # each clip decoded (mono float32)
    key: bytes = b""  # the memo's key for the images (b"": not kept, as for a prompt with audio)
    seen: Seen | None = None

    @staticmethod
    def decoded(items: list[Image], key: bytes = b"", sounds: list[np.ndarray] | None = None) -> PromptMedia:
        """`items`' images decoded (a 400 naming the one that cannot be); `sounds`, their clips'."""
        return PromptMedia(items, [open_image(i) for i in items if i.kind == "image"], sounds or [], key)


def read_media(memo: ImageMemo, parts: list[ImagePart | AudioPart], rate: int = 16000,
               longest: float = 30.0) -> PromptMedia:
    """A request's image and audio parts: its images from the memo when the same parts were seen
    lately (nothing decoded), else decoded from base64 and by Pillow; its clips (none for the
    memo) decoded at `rate`, at most `longest` seconds each. Blocking."""
    if any(isinstance(p, AudioPart) for p in parts):
        items = [Image.of(p.data, p.where, "audio") if isinstance(p, AudioPart) else Image.of(p.data(), p.where)
                 for p in parts]
        sounds = [open_audio(i, p.format, rate, longest) for i, p in zip(items, parts, strict=True)
                  if isinstance(p, AudioPart)]
        return PromptMedia.decoded(items, sounds=sounds)
    images = [p for p in parts if isinstance(p, ImagePart)]
    key = source_key([p.uri for p in images])
    if (seen := memo.get(key)) is not None:
        return PromptMedia([Image(b"", d, p.where) for d, p in zip(seen.digests, images, strict=True)], None, [], key,
                           seen)
    decoded = PromptMedia.decoded([Image.of(p.data(), p.where) for p in images], key)
    assert decoded.pictures is not None
    made = memo.process(decoded.pictures, [i.digest for i in decoded.items])
    return decoded if made is None else PromptMedia(decoded.items, None, [], key, made)


class _Replay:
    """Stands in for a processor's image processor: answers from `outputs` (a copy each time,
    since processors pop from it), or calls the real one and keeps its answer in `kept`."""

    def __init__(self, inner: Any, outputs: Any = None) -> None:
        self._inner = inner
        self._outputs = outputs
        self.kept: Any = None
        self.call: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # how the processor called it

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.call = (args, kwargs)
        if self._outputs is not None:
            return _shell(self._outputs)
        out = self._inner(*args, **kwargs)
        self.kept = _shell(out)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _shell(out: Any) -> Any:
    """A copy of an image processor's answer whose dicts, lists and tuples are new (a processor may
    pop from them) and whose arrays are shared (none changes them)."""
    if isinstance(out, Mapping):
        fresh: Any = copy.copy(out)  # a BatchFeature stays one
        for k, v in out.items():
            fresh[k] = _shell(v)
        return fresh
    if isinstance(out, list | tuple):
        return type(out)(_shell(v) for v in out)
    return out


def _with_pictures(value: Any, stand: list[Any], pictures: list[Any]) -> Any:
    """`value` (an argument the processor gave its image processor, for the stand-ins `stand`)
    with `pictures` in their place: a list of stand-ins becomes the list of pictures, at any depth
    of lists (a Gemma 3 passes a list per prompt), and in a dict's values."""
    if isinstance(value, dict):
        return {k: _with_pictures(v, stand, pictures) for k, v in value.items()}
    if isinstance(value, list | tuple):
        if value and all(any(v is s for s in stand) for v in value):
            return type(value)(pictures)
        return type(value)(_with_pictures(v, stand, pictures) for v in value)
    if any(value is s for s in stand):
        raise ValueError("a lone picture where a list was expected")
    return value


def same_outputs(a: Any, b: Any) -> bool:
    """Whether two processor outputs hold the same arrays (dicts, lists of arrays, arrays)."""
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return (isinstance(a, Mapping) and isinstance(b, Mapping) and a.keys() == b.keys()
                and all(same_outputs(a[k], b[k]) for k in a))
    if isinstance(a, list | tuple) or isinstance(b, list | tuple):
        return (isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b)
                and all(same_outputs(x, y) for x, y in zip(a, b, strict=True)))
    x, y = np.asarray(a), np.asarray(b)
    return x.shape == y.shape and bool(np.array_equal(x, y))


def _nbytes(out: Any) -> int:
    if isinstance(out, Mapping):
        return sum(_nbytes(v) for v in out.values())
    if isinstance(out, list | tuple):
        return sum(_nbytes(v) for v in out)
    return int(getattr(out, "nbytes", 0))


class ImageMemo:
    """Recently seen images' processor outputs, by what was sent (see the module's doc)."""

    def __init__(self, max_bytes: int = MAX_BYTES, max_entries: int = MAX_ENTRIES) -> None:
        self._max_bytes = max_bytes
        self._max_entries = max_entries
        self._entries: OrderedDict[bytes, Seen] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.trusted: bool | None = None  # whether the processor passed the check (None: not yet checked)
        # How the processor calls its image processor (stand-ins in the pictures' place), once that
        # call was checked to give what the processor's own gives: then `process` runs it anywhere.
        self._call: tuple[Any, tuple[Any, ...], dict[str, Any], list[Any]] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Seen | None:
        with self._lock:
            seen = self._entries.get(key) if self.trusted is not False else None
            if seen is not None:
                self._entries.move_to_end(key)
            return seen

    def _put(self, key: bytes, seen: Seen) -> None:
        if seen.nbytes > self._max_bytes:
            return
        with self._lock:
            if (old := self._entries.pop(key, None)) is not None:
                self._bytes -= old.nbytes
            self._entries[key] = seen
            self._bytes += seen.nbytes
            while self._bytes > self._max_bytes or len(self._entries) > self._max_entries:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= gone.nbytes

    def run(self, processor: Any, call: Callable[[list[Any]], Any], images: PromptMedia) -> Any:
        """`call(pictures)`: the processor on the prompt's text and these pictures. For images
        seen lately it runs on stand-ins, the image processor answering from the memo; otherwise
        on the decoded pictures, and what the image processor made of them is kept (when the
        images have a key)."""
        count = len(images.pictures) if images.pictures is not None else len(images.items)
        if (seen := images.seen) is not None:
            out = self._with(processor, _Replay(processor.image_processor, seen.outputs), call, stand_ins(count))
            if seen.fresh and images.key:
                self._put(images.key, Seen(seen.digests, seen.outputs, seen.nbytes))
            return out
        assert images.pictures is not None
        real = processor.image_processor
        replay = _Replay(real)
        out = self._with(processor, replay, call, images.pictures)
        if not images.key:
            return out
        if self.trusted is False or replay.kept is None:
            return out
        if self.trusted is None:  # the first images: do stand-ins give the same answer?
            stand = stand_ins(count)
            probe = _Replay(real, replay.kept)
            try:
                again = self._with(processor, probe, call, stand)
                self.trusted = same_outputs(dict(out), dict(again))
            except Exception:
                self.trusted = False
            if not self.trusted:
                return out
            self._check_call(real, probe, stand, images.pictures, replay.kept)
        self._put(images.key, Seen(tuple(i.digest for i in images.items), replay.kept, _nbytes(replay.kept)))
        return out

    def _check_call(self, real: Any, probe: _Replay, stand: list[Any], pictures: list[Any], want: Any) -> None:
        """Keep how the processor called its image processor (for `process`) if that call, with
        the real pictures in the stand-ins' place, gives what the processor's own call gave."""
        if probe.call is None:
            return
        # The patcher first (the same answer, its patches made on the GPU thread: pixels.py).
        for stand_in in [p for p in (make_patcher(real), real) if p is not None]:
            call = (stand_in, *probe.call, stand)
            try:
                got = _called(call, pictures)
            except Exception:
                continue
            if same_outputs(got, want):
                self._call = call
                return

    def process(self, pictures: list[Any], digests: Sequence[bytes]) -> Seen | None:
        """The image processor's answer for `pictures`, made here (on any thread: the image
        decoding pool, several requests at once) the way the processor calls it; None until a
        first request has shown how (then the processor makes it, on the templating thread)."""
        if self._call is None:  # set only once the processor passed its check
            return None
        try:
            out = _called(self._call, pictures)
        except Exception:  # a call shape these pictures do not fit, or a picture it refuses: the
            return None  # processor's own way, which answers a refusal with a 400 naming the part
        return Seen(tuple(digests), out, _nbytes(out), fresh=True)

    @staticmethod
    def _with(processor: Any, image_processor: _Replay, call: Callable[[list[Any]], Any], pictures: list[Any]) -> Any:
        real = processor.image_processor
        processor.image_processor = image_processor
        try:
            return call(pictures)
        finally:
            processor.image_processor = real


def _called(call: tuple[Any, tuple[Any, ...], dict[str, Any], list[Any]], pictures: list[Any]) -> Any:
    """The image processor's answer to the processor's recorded `call`, `pictures` in place of
    its stand-ins."""
    real, args, kwargs, stand = call
    return _shell(real(*_with_pictures(args, stand, pictures), **_with_pictures(kwargs, stand, pictures)))


def stand_ins(count: int) -> list[Any]:
    """Pictures for the processor to pass along where the image processor answers from the memo."""
    from PIL import Image as PILImage

    return [PILImage.new("RGB", (32, 32)) for _ in range(count)]
