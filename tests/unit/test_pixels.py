"""Qwen-VL images kept as their resized bytes and patched on the GPU thread (engine/models/pixels.py):
the same patches as mlx-vlm's image processor, to the bit, on the host and through mlx; used by the
image memo only once its answer equalled the processor's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxd.engine.gpu.media import device_array
from mlxd.engine.models import image_memo
from mlxd.engine.models.image_memo import read_media
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.engine.models.pixels import PatchedPixels, QwenPatcher, byte_table, make_patcher
from mlxd.protocol.media import ImagePart
from tests.unit.test_image_memo import prompt_of, uri

# Gemma 4's own feature extractor warns so, as it does on the real model.
pytestmark = pytest.mark.filterwarnings("ignore:At least one mel filter has all zero values")


def picture(width: int, height: int, seed: int = 0) -> Any:
    from PIL import Image as PILImage

    return PILImage.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def qwen(vlms: dict[str, Path]) -> LoadedModel:
    return LoadedModel(vlms["qwen2_vl"], "qwen")


@pytest.mark.parametrize("sizes", [[(112, 112)], [(333, 517), (50, 70)], [(1000, 64)], [(896, 896)]])
def test_the_patches_are_the_image_processors_to_the_bit(qwen: LoadedModel, sizes: list[tuple[int, int]]) -> None:
    real = qwen.processor.image_processor
    patcher = make_patcher(real)
    assert isinstance(patcher, QwenPatcher)
    pictures = [picture(w, h, i) for i, (w, h) in enumerate(sizes)]  # resized (not multiples of 28) and not
    want, got = real(images=pictures), patcher(images=pictures)
    assert isinstance(got["pixel_values"], PatchedPixels)
    assert np.array_equal(got["image_grid_thw"], want["image_grid_thw"])
    host = np.asarray(got["pixel_values"])
    assert host.dtype == want["pixel_values"].dtype and np.array_equal(host, want["pixel_values"])
    on_device = device_array(got["pixel_values"])
    assert isinstance(on_device, mx.array) and np.array_equal(np.array(on_device), host)
    # Kept as bytes: an eighth of the float patches or less (a still image is doubled in time too).
    assert got["pixel_values"].nbytes * 8 <= want["pixel_values"].nbytes + 8 * got["pixel_values"].table.nbytes


def test_the_byte_table_is_the_processors_arithmetic() -> None:
    table = byte_table(1 / 255, [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])
    img = np.arange(256, dtype=np.uint8)[None, :, None].repeat(3, 0).astype(np.float32) * (1 / 255)
    mean = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)[:, None, None]
    std = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)[:, None, None]
    assert np.array_equal(table, ((img - mean) / std)[:, :, 0])
    assert np.array_equal(byte_table(None, None, None)[1], np.arange(256, dtype=np.float32))


def test_the_memo_patches_new_qwen_images_on_the_device_and_keeps_their_bytes(qwen: LoadedModel) -> None:
    prompt_of(qwen, "First.", [ImagePart(uri(70), "a")])  # the check: the patcher's answer was the processor's
    parts = [ImagePart(uri(71, 120), "a")]
    _, media, read = prompt_of(qwen, "A new one?", parts)
    assert read.seen is not None and isinstance(read.seen.outputs["pixel_values"], PatchedPixels)
    assert isinstance(media.arrays["pixel_values"], PatchedPixels)
    assert read.seen.nbytes < np.asarray(media.arrays["pixel_values"]).nbytes / 4
    again = read_media(qwen.image_memo, parts).seen  # kept as it was made
    assert again is not None and not again.fresh and isinstance(again.outputs["pixel_values"], PatchedPixels)


def test_a_patcher_that_differs_from_the_processor_is_not_used(vlms: dict[str, Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A processor version that normalises otherwise: the check finds the patches differ, and the
    memo makes new images with the image processor itself."""
    class Off(QwenPatcher):
        def __init__(self, inner: Any) -> None:
            super().__init__(inner)
            self._table = self._table + np.float32(1e-3)

    monkeypatch.setattr(image_memo, "make_patcher", Off)
    loaded = LoadedModel(vlms["qwen2_vl"], "qwen-off")
    prompt_of(loaded, "First.", [ImagePart(uri(80), "a")])
    _, media, read = prompt_of(loaded, "A new one?", [ImagePart(uri(81, 96), "a")])
    assert read.seen is not None and read.seen.fresh  # still made off the templating thread ...
    assert isinstance(media.arrays["pixel_values"], np.ndarray)  # ... by the image processor


def test_only_the_image_processor_it_knows_is_patched(vlms: dict[str, Path], audio_vlm: Path) -> None:
    for path in (vlms["gemma3"], audio_vlm):
        assert make_patcher(LoadedModel(path, "other").processor.image_processor) is None
    assert make_patcher(object()) is None
