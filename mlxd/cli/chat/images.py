"""Images in `mlxd run`: paths to image files written in a message (as `ollama run` takes them) and
`/image PATH`, sent as `image_url` parts with data: URIs of the files' bytes."""

from __future__ import annotations

import base64
import re
import shlex
from pathlib import Path

IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
               ".gif": "image/gif", ".bmp": "image/bmp"}
MAX_BYTES = 20 << 20  # the server's limit for one image
TRAILING = ".,;:!?)"
# A path ending in an image extension: quoted, or unquoted with backslash-escaped spaces.
_PATH = re.compile(r"""(?:'([^']+)'|"([^"]+)"|((?:[^\s'"\\]|\\.)+))""")


class ImageError(ValueError):
    """A file that cannot be sent as an image; `str()` says why."""


def is_image_path(text: str) -> bool:
    return Path(text).suffix.lower() in IMAGE_TYPES


def split_images(message: str) -> tuple[str, list[Path]]:
    """The message without the image files it names (those that exist), and those files in order.
    A word that looks like an image path but names no file stays in the text."""
    found: list[Path] = []

    def take(match: re.Match[str]) -> str:
        raw = next(g for g in match.groups() if g is not None)
        trail = ""
        if match.group(3) is not None:  # unquoted: a sentence's punctuation may follow the path
            word = raw.replace("\\ ", " ")
            trail = word[len(word.rstrip(TRAILING)):]
            word = word[: len(word) - len(trail)]
        else:
            word = raw
        path = Path(word).expanduser()
        if not is_image_path(word) or not path.is_file():
            return match.group(0)
        found.append(path)
        return trail

    text = _PATH.sub(take, message)
    return (re.sub(r"[ \t]{2,}", " ", text).strip() if found else message), found


def image_path(argument: str) -> Path:
    """`/image PATH`'s file, checked (quotes and `~` allowed)."""
    try:
        words = shlex.split(argument)
    except ValueError as exc:
        raise ImageError(f"cannot read the path: {exc}") from None
    if len(words) != 1:
        raise ImageError("Usage: /image PATH")
    path = Path(words[0]).expanduser()
    check(path)
    return path


def check(path: Path) -> None:
    if not is_image_path(str(path)):
        raise ImageError(f"{path} is not an image file ({', '.join(sorted(IMAGE_TYPES))})")
    if not path.is_file():
        raise ImageError(f"{path}: no such file")
    if path.stat().st_size > MAX_BYTES:
        raise ImageError(f"{path} is over 20 MB")


def image_part(path: Path) -> dict[str, object]:
    """An OpenAI `image_url` part with the file's bytes."""
    check(path)
    data = base64.b64encode(path.read_bytes()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:{IMAGE_TYPES[path.suffix.lower()]};base64,{data}"}}


def content(text: str, images: list[Path]) -> str | list[dict[str, object]]:
    """A user message's content: the text, or the images then the text as content parts."""
    if not images:
        return text
    text_part: list[dict[str, object]] = [{"type": "text", "text": text}] if text else []
    return [*(image_part(p) for p in images), *text_part]
