"""Rows with images (engine/gpu/media.py): the cache key, the rotary shift, and that a Qwen-VL row
shifted into lane positions decodes as the model places it."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxd.engine.gpu import image_batch, media
from mlxd.engine.models.image_memo import PromptMedia
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.engine.models.vision import KEY_BASE, Image, MediaPrompt, runs_of


def png(seed: int) -> bytes:
    from PIL import Image as PILImage

    out = io.BytesIO()
    PILImage.fromarray((np.random.RandomState(seed).rand(120, 100, 3) * 255).astype("uint8")).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def qwen(vlms: dict[str, Path]) -> LoadedModel:
    return LoadedModel(vlms["qwen2_vl"], "qwen")


class Job:
    def __init__(self, prompt: list[int], media_prompt: MediaPrompt) -> None:
        self.prompt, self.media = prompt, media_prompt


def image_prompt(loaded: LoadedModel, seed: int) -> tuple[list[int], MediaPrompt]:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    image = Image.of(png(seed))
    return loaded.media_prompt(messages, None, None, PromptMedia.decoded([image]))


def test_runs_and_the_key_cover_each_image_by_its_digest() -> None:
    ids = np.array([1, 7, 7, 7, 2, 7, 7, 3])
    assert runs_of(ids, 7) == [(1, 4), (5, 7)]
    a, b = Image.of(b"one"), Image.of(b"two")
    prompt = MediaPrompt({}, [(1, 4), (5, 7)], [a.digest, b.digest])
    key = prompt.key([*ids.tolist(), 9, 9])  # a history: the prompt, then generated tokens
    assert key[0] == 1 and key[4] == 2 and key[7] == 3 and key[-2:].tolist() == [9, 9]
    assert (key[1:4] >= KEY_BASE).all() and (key[5:7] >= KEY_BASE).all() and key.max() < 2**32
    other = MediaPrompt({}, [(1, 4), (5, 7)], [b.digest, b.digest]).key(ids)
    assert other[1] != key[1] and other[5:7].tolist() == key[5:7].tolist()  # the same image, the same ids
    assert prompt.key(ids[:3]).tolist()[:1] == [1]  # a prefix shorter than the image


def test_a_shift_and_its_inverse_give_the_keys_back(qwen: LoadedModel) -> None:
    kv = make_prompt_cache(qwen.model)
    qwen.model(mx.array([[5, 6, 7, 8, 9]]), cache=kv)
    back = media.shift(media.shift(kv, -240, qwen), 240, qwen)
    for before, after in zip(kv, back, strict=True):
        assert mx.allclose(before.keys[..., :5, :], after.keys, atol=1e-4).item()
        assert after.values is not None and after.offset == 5


def test_a_shift_matches_mlx_rope_by_the_same_positions() -> None:
    keys = mx.random.normal((1, 2, 3, 16))
    want = mx.fast.rope(keys.reshape(6, 1, 16), 16, traditional=False, base=1e6, scale=1.0, offset=37).reshape(1, 2, 3, 16)
    assert mx.allclose(media.rotate(keys, 37, 1e6), want, atol=1e-5).item()


def decode_logits(qwen: LoadedModel, kv: list[Any], token: int, position: int | None) -> mx.array:
    """The next token's logits after `token`: at `position` in all three sections (the model's own
    placing), or through the lanes' TextView (by the cache offset) when None."""
    if position is None:
        return qwen.model(mx.array([[token]]), cache=kv)[0, -1]
    ids = mx.array([[token]])
    return qwen.vlm.language_model(ids, cache=kv, position_ids=mx.full((3, 1, 1), position)).logits[0, -1]


def test_a_shifted_row_decodes_as_the_model_places_its_text(qwen: LoadedModel) -> None:
    prompt, prompt_media = image_prompt(qwen, 0)
    job: Any = Job(prompt, prompt_media)
    end = len(prompt) - 1
    native = make_prompt_cache(qwen.model)
    media.prefill(qwen, prompt_media, prompt, native, 0, end, 16)
    delta = media.rope_delta(qwen, prompt_media, prompt)
    assert delta < 0  # the image's tokens take fewer positions than tokens
    shifted, done = media.complete(qwen, job, prompt, None, 0, 16)
    assert done == end and shifted is not None
    want = decode_logits(qwen, native, prompt[-1], end + delta)
    got = decode_logits(qwen, shifted, prompt[-1], None)
    assert mx.allclose(want, got, atol=1e-4).item()


@pytest.mark.parametrize("images", [1, 2])
def test_qwen_positions_worked_out_here_are_mlx_vlms(qwen: LoadedModel, images: int) -> None:
    content: list[dict[str, Any]] = [{"type": "image"}, {"type": "text", "text": "and"}] * images
    shown = [Image.of(png(seed)) for seed in range(images)]
    prompt, prompt_media = qwen.media_prompt([{"role": "user", "content": [*content, {"type": "text", "text": "?"}]}],
                                             None, None, PromptMedia.decoded(shown))
    mine, delta = media._positions(qwen.vlm, prompt_media, prompt)
    theirs, their_delta = media._model_positions(qwen.vlm, prompt_media, prompt)
    assert delta == their_delta < 0 and mx.array_equal(mine, theirs.astype(mine.dtype)).item()


def question_prompt(loaded: LoadedModel, seed: int, question: str) -> tuple[list[int], MediaPrompt]:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return loaded.media_prompt(messages, None, None, PromptMedia.decoded([Image.of(png(seed))]))


def test_rows_prefilled_as_one_batch_hold_what_each_holds_alone(qwen: LoadedModel) -> None:
    asked = [question_prompt(qwen, 0, "What is it?"),
             question_prompt(qwen, 1, "Say what this picture shows, and what colours it has, in a few words."),
             question_prompt(qwen, 2, "Colours?")]
    jobs: list[Any] = [Job(prompt, prompt_media) for prompt, prompt_media in asked]
    assert len({len(job.prompt) for job in jobs}) == 3  # the shorter rows are padded
    assert all(image_batch.batchable(qwen, job, 0) for job in jobs)
    together = image_batch.start_rows(qwen, jobs, 8)  # 8 tokens a step: several forwards, each over every row
    for i, (prompt, prompt_media) in enumerate(asked):
        fresh: Any = Job(prompt, MediaPrompt(prompt_media.arrays, prompt_media.spans, prompt_media.digests))
        alone, n = media.complete(qwen, fresh, prompt, None, 0, 16)
        kv, done = together[i]
        assert done == n == len(prompt) - 1 and jobs[i].media.rope_delta == fresh.media.rope_delta < 0
        assert alone is not None
        for mine, theirs in zip(kv, alone, strict=True):
            assert mine.offset == theirs.offset == n and mine.keys.shape == theirs.keys.shape
            assert mx.allclose(mine.keys, theirs.keys, atol=1e-5).item()
            assert mx.allclose(mine.values, theirs.values, atol=1e-5).item()


def test_a_row_the_cache_holds_much_of_or_an_image_of_is_not_batched(qwen: LoadedModel) -> None:
    prompt, prompt_media = image_prompt(qwen, 0)
    job: Any = Job(prompt, prompt_media)
    start = prompt_media.spans[0][0]
    assert image_batch.batchable(qwen, job, start)  # the text before its image: prefilled again in the batch
    assert not image_batch.batchable(qwen, job, start + 1)  # part of its image is cached: it starts from that
    no_image: Any = Job(prompt, None)
    assert not image_batch.batchable(qwen, no_image, 0)


def test_batches_group_rows_of_like_length_longest_first() -> None:
    assert image_batch.batches([1000, 900, 400, 800, 300, 740], 8) == [[0, 1, 3], [5], [2, 4]]  # 740 < 3/4 of 1000
    assert image_batch.batches([10] * 5, 2) == [[0, 1], [2, 3], [4]]
    assert image_batch.batches([90, 30, 20], 8) == [[0, 1], [2]]  # a short prompt's padding: up to PAD_SLACK tokens
    assert image_batch.batches([], 8) == []


def twin_and_mrope_logits(view: Any, ids: mx.array) -> tuple[mx.array, mx.array]:
    """The lanes' logits for `ids` through the text twin, and through mlx-vlm's own language model."""
    twin = view._twin
    view._twin = None
    try:
        theirs = view(ids, cache=make_prompt_cache(view))
    finally:
        view._twin = twin
    return view(ids, cache=make_prompt_cache(view)), theirs


def test_a_qwen2_vls_text_twin_is_mlx_lms_qwen2_and_answers_as_its_language_model(qwen: LoadedModel) -> None:
    assert type(qwen.model._twin).__module__ == "mlx_lm.models.qwen2"
    mine, theirs = twin_and_mrope_logits(qwen.model, mx.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]))
    assert mx.allclose(mine, theirs, atol=1e-5).item()


def test_a_quantized_qwen2_vl_gets_a_quantized_twin_and_a_gemma_none(vlms: dict[str, Path]) -> None:
    import mlx.nn as nn

    from mlxd.engine.models.vision import load_vlm, text_twin

    vlm, _ = load_vlm(vlms["qwen2_vl"])
    vlm.language_model.set_dtype(mx.bfloat16)  # the twin is made in float32, and takes the weights' own
    nn.quantize(vlm.language_model, group_size=32, bits=4)
    twin = text_twin(vlm)
    assert twin is not None and isinstance(twin.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert twin.model.layers[0].self_attn.q_proj.scales is vlm.language_model.model.layers[0].self_attn.q_proj.scales
    ids = mx.array([[5, 6, 7, 8, 9]])
    want = vlm.language_model(ids, cache=make_prompt_cache(vlm.language_model)).logits
    got = twin(ids, cache=make_prompt_cache(twin))
    assert got.dtype == want.dtype == mx.bfloat16 and mx.allclose(got, want, atol=1e-2).item()
    gemma, _ = load_vlm(vlms["gemma3"])
    assert text_twin(gemma) is None
