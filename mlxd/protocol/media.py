"""Images and audio in a chat message's content, as OpenAI's chat API sends them: `image_url`
parts (a `data:` URI, or an http(s) URL the supervisor fetches and turns into one before the
engine sees it) and `input_audio` parts (base64 with its format). Pure: both processes use it.

The supervisor rewrites remote URLs (supervisor/media_fetch.py); the engine decodes the data
and hands the bytes to the model's processor (engine/models/vision.py).
"""

from __future__ import annotations

import binascii
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlxd.protocol.errors import APIError


def _fast_b64decode() -> Callable[..., bytes] | None:
    """pybase64's decoder (the vision extra brings it); None without it."""
    try:
        import pybase64
    except ImportError:
        return None
    return pybase64.b64decode


FAST_B64DECODE = _fast_b64decode()

MAX_IMAGE_BYTES = 20 << 20  # one image part's bytes (decoded)
MAX_AUDIO_BYTES = 25 << 20  # one audio part's bytes (OpenAI's own limit)
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "m4a", "webm")
_DATA_URI = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[^;,]*)*?)(?P<b64>;base64)?,", re.ASCII)


@dataclass(frozen=True, slots=True)
class ImagePart:
    uri: str  # the data: URI as sent (decoded by data(): the engine skips that for images it has seen)
    where: str  # messages[i].content[j], for errors

    def data(self) -> bytes:
        """The image's bytes; a 400 naming the part for a malformed or oversize URI."""
        return decode_data_uri(self.uri, self.where, MAX_IMAGE_BYTES, "image")


@dataclass(frozen=True, slots=True)
class AudioPart:
    data: bytes
    format: str
    where: str


Part = str | ImagePart | AudioPart


def image_url_of(part: dict[str, Any]) -> Any:
    """An `image_url` part's URL: `{"image_url": {"url": ...}}`, or the string some clients send."""
    value = part.get("image_url")
    return value.get("url") if isinstance(value, dict) else value


def content_parts(content: Any, index: int) -> list[Part]:
    """A message's content as text and media parts, in order; a malformed part is a 400 naming it."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    parts: list[Part] = []
    for j, part in enumerate(content):
        where = f"messages[{index}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise APIError(400, "A text content part needs a string 'text'.", param=where)
            parts.append(part["text"])
        elif kind == "image_url":
            url = image_url_of(part)
            if not isinstance(url, str) or not url:
                raise APIError(400, "An image_url part needs image_url.url, a data: URI or an http(s) URL.", param=where)
            check_data_uri(url, where, MAX_IMAGE_BYTES, "image")
            parts.append(ImagePart(url, where))
        elif kind == "input_audio":
            audio = part.get("input_audio")
            if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
                raise APIError(400, "An input_audio part needs input_audio.data (base64) and input_audio.format.",
                               param=where)
            fmt = str(audio.get("format") or "wav").lower()
            if fmt not in AUDIO_FORMATS:
                raise APIError(400, f"Audio format {fmt!r} is not supported (one of {', '.join(AUDIO_FORMATS)}).",
                               param=where)
            parts.append(AudioPart(decode_base64(audio["data"], where, MAX_AUDIO_BYTES, "audio"), fmt, where))
        else:
            raise APIError(400, f"Content part type {kind!r} is not supported; send 'text', 'image_url' or "
                                "'input_audio' parts.", param=where)
    return parts


def has_media(content: Any) -> bool:
    """Whether a message's content holds an image or audio part (a cheap look, no decoding)."""
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") in ("image_url", "input_audio") for p in content)


def decode_data_uri(url: str, where: str, max_bytes: int, what: str) -> bytes:
    """The bytes of a `data:` URI (base64 or percent-encoded); a remote URL here is a 400 (the
    supervisor fetches those before the engine sees the request)."""
    head = check_data_uri(url, where, max_bytes, what)
    payload = url[head.end():]
    if head.group("b64"):
        return decode_base64(payload, where, max_bytes, what)
    from urllib.parse import unquote_to_bytes

    data = unquote_to_bytes(payload)
    _check_size(len(data), where, max_bytes, what)
    return data


def check_data_uri(url: str, where: str, max_bytes: int, what: str) -> re.Match[str]:
    """A 400 for what cannot be a `data:` URI of at most `max_bytes` (a look at its head and
    length, nothing decoded); its head matched."""
    if url[:5].lower() != "data:":
        scheme = url.split(":", 1)[0][:16] if ":" in url else ""
        if scheme.lower() in ("http", "https"):
            raise APIError(400, f"The {what} URL was not fetched: send it through mlxd's supervisor, or as a data: URI.",
                           param=where, code="invalid_image_url")
        raise APIError(400, f"An {what} must be a data: URI or an http(s) URL.", param=where, code="invalid_image_url")
    head = _DATA_URI.match(url)
    if head is None:
        raise APIError(400, f"The {what}'s data: URI is malformed.", param=where, code="invalid_image_url")
    if head.group("b64"):  # base64 is 4/3 of the bytes: refuse before decoding what would be too big anyway
        _check_size((len(url) - head.end()) * 3 // 4 - 2, where, max_bytes, what)
    return head


def _strict_b64decode(text: str) -> bytes:
    """Base64 to bytes, refusing anything but its alphabet and padding (binascii.Error).
    pybase64 (the vision extra's) where installed: SIMD, 0.3 ms for a 3.2 MB image where
    binascii takes 12 ms holding the GIL, which queued every other request's images behind it."""
    if FAST_B64DECODE is not None:
        return FAST_B64DECODE(text, validate=True)
    return binascii.a2b_base64(text, strict_mode=True)


def decode_base64(text: str, where: str, max_bytes: int, what: str) -> bytes:
    # Base64 is 4/3 of the bytes: refuse before decoding what would be too big anyway.
    _check_size(len(text) * 3 // 4 - 2, where, max_bytes, what)
    try:
        try:  # strict and fast; a body that wraps its base64 in lines is tried again without them
            return _strict_b64decode(text)
        except binascii.Error:
            joined = "".join(text.split())
            if joined == text:
                raise
            return _strict_b64decode(joined)
    except (binascii.Error, ValueError) as exc:
        raise APIError(400, f"The {what}'s base64 data is malformed ({exc}).", param=where,
                       code=f"invalid_{what}") from exc


def _check_size(n: int, where: str, max_bytes: int, what: str) -> None:
    if n > max_bytes:
        raise APIError(400, f"The {what} is {n} bytes; at most {max_bytes} bytes are taken.", param=where,
                       code=f"{what}_too_large")
