"""Audio in, through a real supervisor and engine: a tiny random Gemma 4 shape from mlx-vlm's classes
(a vision tower and an audio tower), asked with the openai SDK's `input_audio` parts."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import shutil
import subprocess
import sys
import wave
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from tests.integration.test_vision import ask, config, image_message, png, token_ids
from tests.support import SupervisorProcess


def wav(seconds: float, hz: float = 440.0, rate: int = 16000, channels: int = 1) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    samples = (0.3 * np.sin(2 * np.pi * hz * t) * 32767).astype(np.int16)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(samples[:, None], channels, axis=1).tobytes())
    return out.getvalue()


def audio_message(data: bytes, text: str = "What is this sound?", fmt: str = "wav") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}},
        {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def sup(audio_vlm: Path, vlms: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    proc = SupervisorProcess(config({"gemma4": audio_vlm, "qwen2_vl": vlms["qwen2_vl"]}),
                             tmp_path_factory.mktemp("audio")).wait_up()
    yield proc
    proc.stop()


def test_an_audio_request_answers_and_counts_its_audio_tokens(sup: SupervisorProcess) -> None:
    client = sup.openai()
    text_only = ask(client, "gemma4", [{"role": "user", "content": "What is this sound?"}])
    short = ask(client, "gemma4", audio_message(wav(0.5)))
    # 44.1 kHz stereo, resampled and mixed down: one second is 25 tokens of 40 ms.
    longer = ask(client, "gemma4", audio_message(wav(1.0, rate=44100, channels=2)))
    assert short.choices[0].finish_reason == "length" and len(token_ids(short)) == 8
    # Half a second is 13 audio tokens (and the clip's two markers) in prompt_tokens.
    assert short.usage.prompt_tokens == text_only.usage.prompt_tokens + 13 + 2
    assert longer.usage.prompt_tokens == short.usage.prompt_tokens + 12


def test_the_same_clip_hits_the_cache_and_another_clip_misses(sup: SupervisorProcess) -> None:
    client = sup.openai()
    ask(client, "gemma4", audio_message(wav(0.5, 220.0), "Describe it."))  # the template's opening cached
    first = ask(client, "gemma4", audio_message(wav(0.5, 330.0), "Describe it."))
    again = ask(client, "gemma4", audio_message(wav(0.5, 330.0), "Describe it."))
    other = ask(client, "gemma4", audio_message(wav(0.5, 550.0), "Describe it."))
    prompt = first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == prompt - 1
    assert token_ids(again) == token_ids(first)
    opening = first.usage.prompt_tokens_details.cached_tokens
    assert other.usage.prompt_tokens == prompt and other.usage.prompt_tokens_details.cached_tokens == opening < prompt - 13


def test_images_and_audio_in_one_message(sup: SupervisorProcess) -> None:
    client = sup.openai()
    image = image_message(png(3))[0]["content"][0]
    clip = audio_message(wav(0.5))[0]["content"][0]
    both = ask(client, "gemma4", [{"role": "user", "content": [image, clip, {"type": "text", "text": "Both?"}]}])
    swapped = ask(client, "gemma4", [{"role": "user", "content": [clip, image, {"type": "text", "text": "Both?"}]}])
    assert both.usage.prompt_tokens == swapped.usage.prompt_tokens
    assert both.usage.prompt_tokens > ask(client, "gemma4", audio_message(wav(0.5), "Both?")).usage.prompt_tokens + 2
    # Two images of different sizes (a Gemma 4 keeps each at its own: its pixels are ragged) and a clip.
    other = image_message(png(5, 160, 90))[0]["content"][0]
    three = ask(client, "gemma4", [{"role": "user", "content": [image, clip, other, {"type": "text", "text": "All?"}]}])
    assert three.choices[0].finish_reason == "length" and three.usage.prompt_tokens > both.usage.prompt_tokens


def test_a_batch_mixing_audio_image_and_text_rows_matches_each_alone(audio_vlm: Path, tmp_path: Path) -> None:
    proc = SupervisorProcess(config({"gemma4": audio_vlm}, "batch = 4\n", "prompt_cache_bytes = 0\n"), tmp_path).wait_up()
    try:
        client = proc.openai()
        requests = [audio_message(wav(0.5, 300.0)), [{"role": "user", "content": "Hello there, how are you?"}],
                    image_message(png(21), "What is it?"), audio_message(wav(0.8, 500.0), "And this one?")]
        alone = [token_ids(ask(client, "gemma4", m, max_tokens=12, user=f"alone{i}")) for i, m in enumerate(requests)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda m: token_ids(ask(client, "gemma4", m, max_tokens=12)), requests))
        assert together == alone
    finally:
        proc.stop()


def bad_audio(sup: SupervisorProcess, model: str, data: bytes, fmt: str = "wav") -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        ask(sup.openai(), model, audio_message(data, fmt=fmt))
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "messages[0].content[0]", body
    return body


def test_a_bad_clip_is_a_400_naming_it_and_the_engine_lives_on(sup: SupervisorProcess) -> None:
    assert bad_audio(sup, "gemma4", b"RIFF....WAVEfmt not really")["code"] == "invalid_audio"
    assert bad_audio(sup, "gemma4", wav(31.0))["code"] == "audio_too_long"  # a Gemma 4 hears 30 s a clip
    assert bad_audio(sup, "qwen2_vl", wav(0.5))["code"] == "unsupported_content"  # images only
    assert ask(sup.openai(), "gemma4", audio_message(wav(0.5))).choices[0].finish_reason == "length"


@pytest.mark.skipif(shutil.which("ffmpeg") is not None, reason="with ffmpeg on the PATH, ogg decodes")
def test_a_format_that_needs_ffmpeg_says_so_where_there_is_none(sup: SupervisorProcess) -> None:
    body = bad_audio(sup, "gemma4", b"OggS" + bytes(60), "ogg")
    assert body["code"] == "invalid_audio" and "ffmpeg" in body["message"]


def test_the_model_list_says_the_model_takes_audio(sup: SupervisorProcess) -> None:
    listed = {m.id: m.model_dump() for m in sup.openai().models.list().data}
    assert "audio" in listed["gemma4"]["capabilities"] and "vision" in listed["gemma4"]["capabilities"]
    assert "audio" not in listed["qwen2_vl"]["capabilities"]


RAW = """
import io, json, sys
from mlx_vlm import load, stream_generate
from PIL import Image
model, processor = load(sys.argv[1])
clip, picture = open(sys.argv[2], "rb").read(), open(sys.argv[3], "rb").read()
out = []
for kinds in (("audio",), ("image",), ("audio", "image")):
    parts = [{"type": kind} for kind in kinds] + [{"type": "text", "text": "What is it?"}]
    prompt = processor.tokenizer.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                                     tokenize=False)
    media = {}
    if "audio" in kinds:
        media["audio"] = [io.BytesIO(clip)]
    if "image" in kinds:
        media["image"] = [Image.open(io.BytesIO(picture)).convert("RGB")]
    out.append([processor.tokenizer.decode([r.token])
                for r in stream_generate(model, processor, prompt, max_tokens=10, temperature=0.0, **media)][:10])
print(json.dumps(out))
"""


def test_answers_are_mlx_vlms_own_token_for_token(sup: SupervisorProcess, audio_vlm: Path, tmp_path: Path) -> None:
    """What the engine builds on top (its prefill from the towers' embeddings, mlx-lm's caches and
    lanes) answers as mlx-vlm's own generate does (in a process of its own, as a user runs it),
    greedy, for a clip, an image and both."""
    clip, picture = wav(0.6, 400.0), png(4)
    (tmp_path / "clip.wav").write_bytes(clip)
    (tmp_path / "picture.png").write_bytes(picture)
    raw = subprocess.run([sys.executable, "-c", RAW, str(audio_vlm), str(tmp_path / "clip.wav"),
                          str(tmp_path / "picture.png")], capture_output=True, text=True, timeout=300, check=True)
    theirs = json.loads(raw.stdout.strip().splitlines()[-1])
    for kinds, expected in zip((("audio",), ("image",), ("audio", "image")), theirs, strict=True):
        content = [audio_message(clip)[0]["content"][0] if kind == "audio" else image_message(picture)[0]["content"][0]
                   for kind in kinds] + [{"type": "text", "text": "What is it?"}]
        mine = token_ids(ask(sup.openai(), "gemma4", [{"role": "user", "content": content}], max_tokens=10))
        assert mine == expected, kinds
