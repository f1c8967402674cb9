"""The supervisor's cheap look at an OpenAI body before it decodes one to fetch image URLs
(supervisor/http/image_fetch.py): every http(s) image URL JSON can spell is seen; data URIs and
URLs in plain text are not."""

from __future__ import annotations

import base64
import json

import pytest

from mlxd.supervisor.http.image_fetch import may_hold_urls


def body(url: str, escape_slashes: bool = False) -> bytes:
    text = json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "see the picture"}, {"type": "image_url", "image_url": {"url": url}}]}]})
    return (text.replace("/", "\\/") if escape_slashes else text).encode()


@pytest.mark.parametrize("url", ["https://example.com/a.png", "http://10.0.0.1/b.jpg", "HTTPS://EXAMPLE.COM/C.PNG"])
@pytest.mark.parametrize("escape_slashes", [False, True])
def test_an_http_image_url_is_seen_however_json_spells_it(url: str, escape_slashes: bool) -> None:
    assert may_hold_urls(body(url, escape_slashes))
    spaced = body(url).replace(b'"url": ', b'"url"  :\n  ')
    assert may_hold_urls(spaced)


def test_data_uris_and_urls_in_words_are_not_fetched() -> None:
    payload = base64.b64encode(b"https://not-a-url-but-bytes" * 100).decode()
    assert not may_hold_urls(body("data:image/png;base64," + payload))
    words = json.dumps({"messages": [{"role": "user", "content": "what is at https://example.com?"}]}).encode()
    assert not may_hold_urls(words)
