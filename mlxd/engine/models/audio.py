"""Audio parts for a vision-language model with an audio tower (a Gemma 4, say): which models take
them, and an `input_audio` part's bytes decoded into what the processor's feature extractor takes
(mono float32 samples at its sampling rate).

Decoding is mlx-audio's (a dependency of mlx-vlm, so the `vision` extra brings it): WAV, MP3 and
FLAC through miniaudio, in-process; the other formats it knows (ogg, m4a, webm, ...) through an
`ffmpeg` on the PATH, and a 400 saying so where there is none. A clip longer than the model's
audio window is a 400, never cut short without a word. Blocking, numpy only.
"""

from __future__ import annotations

import io
import shutil
from typing import Any

import numpy as np

from mlxd.engine.models.vision import Image
from mlxd.protocol.errors import APIError

DEFAULT_MAX_SECONDS = 30.0  # when the processor does not say how much audio its model hears
MINIAUDIO_FORMATS = ("wav", "mp3", "flac")


def audio_token_id(config: dict[str, Any], processor: Any) -> int | None:
    """The token an audio clip's embeddings take the place of; None when the model has no audio
    tower (mlx-vlm builds a default one for some families whose config names none: only a config
    that names its `audio_config` counts) or its processor has no feature extractor."""
    if not isinstance(config.get("audio_config"), dict) or getattr(processor, "feature_extractor", None) is None:
        return None
    for key in ("audio_token_id", "audio_token_index"):
        if (value := config.get(key)) is not None:
            return int(value)
    value = getattr(processor, "audio_token_id", None) or getattr(getattr(processor, "tokenizer", None),
                                                                  "audio_token_id", None)
    return int(value) if value is not None else None


def sampling_rate(processor: Any) -> int:
    return int(getattr(processor.feature_extractor, "sampling_rate", 16000))


def max_seconds(processor: Any) -> float:
    """How much audio the model hears in one clip: its processor's token cap times each token's
    length (a Gemma 4's 750 tokens of 40 ms), else DEFAULT_MAX_SECONDS."""
    tokens, ms = getattr(processor, "audio_seq_length", None), getattr(processor, "audio_ms_per_token", None)
    if isinstance(tokens, int | float) and isinstance(ms, int | float) and tokens > 0 and ms > 0:
        return float(tokens) * float(ms) / 1000.0
    return DEFAULT_MAX_SECONDS


def open_audio(clip: Image, fmt: str, rate: int, longest: float) -> np.ndarray:
    """`clip` (an input_audio part's bytes, said to be `fmt`) as mono float32 samples at `rate`;
    a 400 naming the part for what cannot be decoded or is longer than `longest` seconds."""
    from mlx_audio import audio_io

    where = clip.where
    try:
        samples, _ = audio_io.read(io.BytesIO(clip.data), dtype="float32", sample_rate=rate, nchannels=1,
                                   duration=longest + 0.5)
    except Exception as exc:  # miniaudio's DecodeError, ValueError, ffmpeg's errors: all bad input here
        if fmt not in MINIAUDIO_FORMATS and shutil.which("ffmpeg") is None:
            raise APIError(400, f"The audio in {where} is {fmt}, which needs ffmpeg on the engine's PATH "
                                f"(WAV, MP3 and FLAC need nothing more).", param=where, code="invalid_audio") from exc
        raise APIError(400, f"The audio in {where} is not audio mlxd can read ({type(exc).__name__}: {exc}).",
                       param=where, code="invalid_audio") from exc
    samples = np.asarray(samples, dtype=np.float32).reshape(-1)
    if samples.size == 0:
        raise APIError(400, f"The audio in {where} holds no samples.", param=where, code="invalid_audio")
    if samples.size > longest * rate:
        raise APIError(400, f"The audio in {where} is longer than the {longest:g} seconds this model hears in one "
                            "clip; send it in shorter parts.", param=where, code="audio_too_long")
    return samples
