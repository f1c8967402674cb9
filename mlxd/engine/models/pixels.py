"""Images kept as their resized bytes and patched on the GPU thread, instead of as the float
patches a Qwen-VL image processor makes of them on the host.

mlx-vlm's Qwen-VL image processor (`Qwen3VLImageProcessor`, which Qwen2-VL, Qwen2.5-VL and
Qwen3-VL share) resizes an image with Pillow, then in numpy turns each byte into a float
(rescaled, normalised), doubles the picture along time and cuts it into patches: for an
896x896 image 19 MB of float32, about 25 ms on this 2-core host and 60 ms on the H200's, every
new image. Each byte can only become one of 256 floats per channel, so `QwenPatcher` keeps
the resized bytes (2.4 MB) and a (channels, 256) table of those floats, and the GPU thread
makes the patches with a lookup and a transpose (`PatchedPixels.build`, exact: no arithmetic
happens on the device). The image memo keeps 8x as many images in the same bytes.

Nothing here trusts itself: the image memo (image_memo.py) uses a patcher only after its
answer for a request's real pictures equalled the image processor's own, array for array.
Numpy only; `build` is given the array module (numpy here, mlx on the GPU thread).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True, eq=False)
class PatchedPixels:
    """A prompt's images as a Qwen-VL image processor's `pixel_values` (patches of each image,
    one after another), held as each resized image's bytes."""

    frames: tuple[np.ndarray, ...]  # each image resized, uint8 (channels, height, width)
    table: np.ndarray  # float32 (channels, 256): what each byte of each channel becomes
    patch: int  # patch side, in pixels
    temporal: int  # frames a patch spans in time (a still image is repeated to fill them)
    merge: int  # patches merged into one token, per side

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.frames) + self.table.nbytes

    def build(self, xp: Any, asarray: Any) -> Any:
        """The patches as the image processor lays them out, made with array module `xp`
        (numpy or mlx.core) from arrays `asarray` makes of the host's."""
        table = asarray(self.table).reshape(-1)
        parts = [self._patches(xp, table, asarray(frame)) for frame in self.frames]
        return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=0)

    def _patches(self, xp: Any, table: Any, frame: Any) -> Any:
        channels, height, width = frame.shape
        ps, ms = self.patch, self.merge
        rows, cols = height // ps, width // ps
        index = frame.astype(xp.int32) + (xp.arange(channels, dtype=xp.int32) * 256).reshape(channels, 1, 1)
        x = xp.take(table, index)  # (C, H, W) float32: the processor's rescale and normalise, looked up
        x = x.reshape(channels, rows // ms, ms, ps, cols // ms, ms, ps).transpose(1, 4, 2, 5, 0, 3, 6)
        x = x.reshape(rows * cols, channels, 1, ps, ps)
        return xp.broadcast_to(x, (rows * cols, channels, self.temporal, ps, ps)).reshape(rows * cols, -1)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.build(np, np.asarray)
        return out if dtype is None else out.astype(dtype)


def byte_table(rescale: float | None, mean: Any, std: Any) -> np.ndarray:
    """(channels, 256) float32: each byte value as the processor's numpy turns it into a float
    (the same operations in the same order and dtypes, element by element)."""
    img = np.broadcast_to(np.arange(256, dtype=np.uint8).astype(np.float32), (3, 256))
    if rescale is not None:
        img = img * rescale
    if mean is not None:
        img = (img - np.array(mean, dtype=np.float32)[:, None]) / np.array(std, dtype=np.float32)[:, None]
    return np.ascontiguousarray(img, dtype=np.float32)


class QwenPatcher:
    """Stands in for mlx-vlm's Qwen-VL image processor: the same resize, the patches left to
    `PatchedPixels`."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._module = sys.modules[type(inner).__module__]
        self._table = byte_table(inner.rescale_factor if inner.do_rescale else None,
                                 inner.image_mean if inner.do_normalize else None, inner.image_std)

    def __call__(self, images: Any = None, **kwargs: Any) -> dict[str, Any]:
        mod, inner = self._module, self._inner
        sizing = {k: v for k, v in kwargs.items() if k in mod._IMAGE_PROCESSOR_KWARGS}
        frames, grids = [], []
        for image in mod._flatten_images(images):
            arr = image if isinstance(image, np.ndarray) and image.ndim == 3 else mod._to_numpy_image(image)
            if arr.dtype != np.uint8 or arr.shape[0] != 3:
                raise ValueError("only 8-bit RGB pictures are patched on the device")
            height, width = inner._resolved_size(arr.shape[1], arr.shape[2], **sizing)
            frames.append(np.ascontiguousarray(mod._resize_video_frames(arr[None], height, width)[0]))
            grids.append([1, height // inner.patch_size, width // inner.patch_size])
        pixels = PatchedPixels(tuple(frames), self._table, inner.patch_size, inner.temporal_patch_size, inner.merge_size)
        return {"pixel_values": pixels, "image_grid_thw": np.array(grids, dtype=np.int64)}


def make_patcher(image_processor: Any) -> QwenPatcher | None:
    """A patcher standing in for `image_processor`, for the kind it knows (None: another kind).
    One whose mlx-vlm version lacks what the patcher calls fails the memo's check, which then
    keeps the processor's own way."""
    kind = type(image_processor)
    if kind.__name__ != "Qwen3VLImageProcessor" or not kind.__module__.startswith("mlx_vlm."):
        return None
    try:
        return QwenPatcher(image_processor)
    except (AttributeError, TypeError, ValueError):
        return None
