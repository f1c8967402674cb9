"""The image memo (engine/models/image_memo.py): the same image parts again are neither decoded nor
processed again, and give the prompt and arrays the first time gave; a processor that reads the
pictures some other way is never served from it."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlxd.engine.models.image_memo import (
    ImageMemo,
    PromptMedia,
    read_media,
    same_outputs,
    source_key,
)
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.engine.models.vision import Image, MediaPrompt
from mlxd.protocol.errors import APIError
from mlxd.protocol.media import ImagePart

# Gemma 4's own feature extractor (128 mel filters over 257 bins) warns so, as it does on the real model.
pytestmark = pytest.mark.filterwarnings("ignore:At least one mel filter has all zero values")


def uri(seed: int, side: int = 64) -> str:
    from PIL import Image as PILImage

    out = io.BytesIO()
    PILImage.fromarray((np.random.RandomState(seed).rand(side, side + 8, 3) * 255).astype("uint8")).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module", params=["qwen2_vl", "gemma3", "gemma4"])
def loaded(request: pytest.FixtureRequest, vlms: dict[str, Path], audio_vlm: Path) -> LoadedModel:
    return LoadedModel(vlms.get(request.param, audio_vlm), request.param)


def prompt_of(loaded: LoadedModel, text: str, parts: list[ImagePart]) -> tuple[list[int], MediaPrompt, PromptMedia]:
    images = read_media(loaded.image_memo, parts)
    content: list[dict[str, Any]] = [{"type": "image"} for _ in parts] + [{"type": "text", "text": text}]
    ids, media = loaded.media_prompt([{"role": "user", "content": content}], None, None, images)
    return ids, media, images


def same_arrays(a: MediaPrompt, b: MediaPrompt, only: tuple[str, ...] = ()) -> bool:
    """Whether two prompts' arrays are the same (`only` these, when named)."""
    return same_outputs({k: v for k, v in a.arrays.items() if not only or k in only},
                        {k: v for k, v in b.arrays.items() if not only or k in only})


def test_the_same_images_again_come_from_the_memo_as_the_first_time_made_them(loaded: LoadedModel) -> None:
    parts = [ImagePart(uri(1), "messages[0].content[0]"), ImagePart(uri(2, 96), "messages[0].content[1]")]
    cold_ids, cold, first = prompt_of(loaded, "What differs?", parts)
    assert (first.seen is None or first.seen.fresh) and loaded.image_memo.trusted is True
    # A follow-up: the same parts (sent again as new strings), other words.
    again = [ImagePart(str(p.uri[:-1] + p.uri[-1]), p.where) for p in parts]
    ids, media, second = prompt_of(loaded, "What differs? Say more.", again)
    assert second.seen is not None and second.pictures is None  # nothing decoded
    assert [i.digest for i in second.items] == [i.digest for i in first.items] and not second.items[0].data
    # The images' arrays are the first time's (a Gemma 4's token types follow the words, and differ).
    assert media.spans == cold.spans and same_arrays(media, cold, ("pixel_values", "image_grid_thw"))
    assert ids[: cold.end] == cold_ids[: cold.end] and ids != cold_ids
    # ... and exactly what a fresh processor run makes of that follow-up.
    fresh_ids, fresh = loaded.media_prompt([{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                                         {"type": "text", "text": "What differs? Say more."}]}],
                                           None, None, PromptMedia.decoded(first.items))
    assert fresh_ids == ids and same_arrays(fresh, media)


def test_other_images_or_another_order_miss(loaded: LoadedModel) -> None:
    a, b = ImagePart(uri(11), "a"), ImagePart(uri(12), "b")
    prompt_of(loaded, "?", [a, b])
    assert (hit := read_media(loaded.image_memo, [a, b]).seen) is not None and not hit.fresh
    for miss in ([b, a], [ImagePart(uri(13), "c")]):  # made anew (on the decoding threads), not found
        seen = read_media(loaded.image_memo, miss).seen
        assert seen is None or seen.fresh


def test_new_images_are_processed_off_the_templating_thread_as_the_processor_would(loaded: LoadedModel) -> None:
    prompt_of(loaded, "First.", [ImagePart(uri(30), "a")])  # shows the memo how the processor calls it
    parts = [ImagePart(uri(31, 80), "a"), ImagePart(uri(32, 48), "b")]
    ids, media, read = prompt_of(loaded, "Two new ones?", parts)
    assert read.seen is not None and read.seen.fresh and read.pictures is None  # made on this (the calling) thread
    content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Two new ones?"}]
    own_ids, own = loaded.media_prompt([{"role": "user", "content": content}], None, None,
                                       PromptMedia.decoded(list(read.items)))
    assert own_ids == ids and same_arrays(own, media)
    assert (kept := read_media(loaded.image_memo, parts).seen) is not None and not kept.fresh  # and kept


def test_a_broken_image_is_a_400_and_nothing_is_kept(loaded: LoadedModel) -> None:
    bad = ImagePart("data:image/png;base64," + base64.b64encode(b"not a png at all").decode(), "messages[0].content[0]")
    with pytest.raises(APIError) as info:
        prompt_of(loaded, "?", [bad])
    assert info.value.status == 400 and info.value.param == "messages[0].content[0]"
    assert loaded.image_memo.get(source_key([bad.uri])) is None


class PeekingProcessor:
    """A processor that reads the pictures' sizes itself, not only through its image processor."""

    def __init__(self) -> None:
        self.image_processor = lambda images: {"pixel_values": np.ones((len(images), 4), np.float32)}

    def __call__(self, text: list[str], images: list[Any], **_: Any) -> dict[str, Any]:
        arrays = self.image_processor(images)
        return {"input_ids": np.array([[1] * images[0].size[0]]), **arrays}


def test_a_processor_that_reads_the_pictures_itself_is_never_served_from_the_memo() -> None:
    from PIL import Image as PILImage

    memo, processor = ImageMemo(), PeekingProcessor()
    images = PromptMedia([Image.of(b"five by five")], [PILImage.new("RGB", (5, 5))], key=b"k")
    out = memo.run(processor, lambda pictures: processor(["t"], pictures), images)
    assert out["input_ids"].shape == (1, 5)
    assert memo.trusted is False and len(memo) == 0 and memo.get(b"k") is None


def test_the_memo_keeps_to_its_bytes_oldest_first() -> None:
    class Plain:
        def __init__(self) -> None:
            self.image_processor = lambda images: {"pixel_values": np.zeros((1000,), np.float32)}  # 4000 bytes

        def __call__(self, text: list[str], images: list[Any], **_: Any) -> dict[str, Any]:
            return {"input_ids": np.array([[1, 2]]), **self.image_processor(images)}

    memo, processor = ImageMemo(max_bytes=10_000), Plain()
    for key in (b"a", b"b", b"c"):
        memo.run(processor, lambda pictures: processor(["t"], pictures), PromptMedia([], [], key=key))
    assert memo.trusted is True and len(memo) == 2
    assert memo.get(b"a") is None and memo.get(b"b") is not None and memo.get(b"c") is not None


def test_a_picture_the_image_processor_refuses_is_still_a_400(vlms: dict[str, Path]) -> None:
    """Once images are processed on the decoding threads, one the image processor refuses (a
    Qwen-VL's takes no aspect ratio past 200) goes the processor's own way, to its 400."""
    from PIL import Image as PILImage

    loaded = LoadedModel(vlms["qwen2_vl"], "qwen")
    prompt_of(loaded, "First.", [ImagePart(uri(40), "a")])
    out = io.BytesIO()
    PILImage.new("RGB", (2000, 3)).save(out, "PNG")
    thin = ImagePart("data:image/png;base64," + base64.b64encode(out.getvalue()).decode(), "messages[0].content[0]")
    assert read_media(loaded.image_memo, [thin]).seen is None  # not made off the thread: it failed there
    with pytest.raises(APIError) as info:
        prompt_of(loaded, "?", [thin])
    assert info.value.status == 400 and info.value.code == "invalid_image"


def test_images_read_on_several_threads_at_once_are_each_their_own(loaded: LoadedModel) -> None:
    import concurrent.futures

    prompt_of(loaded, "First.", [ImagePart(uri(50), "a")])
    parts = [[ImagePart(uri(60 + i, 48 + 8 * i), "a")] for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        reads = list(pool.map(lambda p: read_media(loaded.image_memo, p), parts))
    for read in reads:
        assert read.seen is not None and read.seen.fresh
        content = [{"type": "image"}, {"type": "text", "text": "?"}]
        ids, media = loaded.media_prompt([{"role": "user", "content": content}], None, None, read)
        own_ids, own = loaded.media_prompt([{"role": "user", "content": content}], None, None,
                                           PromptMedia.decoded(list(read.items)))
        assert ids == own_ids and same_arrays(media, own)
