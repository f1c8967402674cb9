"""Image and audio content parts (protocol/media.py): decoded, or a 400 naming the part."""

from __future__ import annotations

import base64

import pytest

from mlxd.protocol import media
from mlxd.protocol.errors import APIError
from mlxd.protocol.media import AudioPart, ImagePart, content_parts, decode_data_uri

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n fake").decode()


def test_parts_come_back_in_order_with_their_bytes() -> None:
    parts = content_parts([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                           {"type": "image_url", "image_url": "data:,plain%20bytes"},
                           {"type": "input_audio", "input_audio": {"data": PNG, "format": "MP3"}}], 2)
    assert parts[0] == "a"
    assert isinstance(parts[1], ImagePart) and parts[1].where == "messages[2].content[1]"
    assert parts[1].data() == b"\x89PNG\r\n\x1a\n fake"
    assert isinstance(parts[2], ImagePart) and parts[2].data() == b"plain bytes"
    assert parts[3] == AudioPart(b"\x89PNG\r\n\x1a\n fake", "mp3", "messages[2].content[3]")
    assert content_parts("text", 0) == ["text"] and content_parts(None, 0) == []


@pytest.mark.parametrize("fast", [True, False], ids=["pybase64", "binascii"])
def test_base64_wrapped_in_lines_is_taken_and_broken_base64_is_not(fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    assert media.FAST_B64DECODE is not None  # the vision extra brings pybase64
    if not fast:
        monkeypatch.setattr(media, "FAST_B64DECODE", None)
    big = base64.b64encode(bytes(range(256)) * 4000)
    assert decode_data_uri(f"data:image/png;base64,{big.decode()}", "w", 1 << 20, "image") == bytes(range(256)) * 4000
    wrapped = "\n".join(PNG[i:i + 8] for i in range(0, len(PNG), 8))
    assert decode_data_uri(f"data:image/png;base64,{wrapped}", "w", 1 << 20, "image").startswith(b"\x89PNG")
    for bad in ("AA=A", "%%%", "AAA", "QUJDRA==QUJD", "QUJ$", "-_-_"):
        with pytest.raises(APIError) as info:
            decode_data_uri(f"data:image/png;base64,{bad}", "w", 1 << 20, "image")
        assert info.value.status == 400 and info.value.param == "w" and info.value.code == "invalid_image"


@pytest.mark.parametrize(("part", "code"), [
    ({"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}, "invalid_image_url"),  # not fetched
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "invalid_image_url"),
    ({"type": "input_audio", "input_audio": {"data": PNG, "format": "aiff"}}, None),
    ({"type": "input_audio", "input_audio": "x"}, None),
    ({"type": "image_url"}, None),
    ({"type": "file", "file": {}}, None),
])
def test_a_bad_part_is_a_400_naming_it(part: dict[str, object], code: str | None) -> None:
    with pytest.raises(APIError) as info:
        content_parts([{"type": "text", "text": "x"}, part], 1)
    assert info.value.status == 400 and info.value.param == "messages[1].content[1]"
    if code is not None:
        assert info.value.code == code
