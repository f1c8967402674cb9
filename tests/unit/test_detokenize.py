"""Incremental detokenization (mlx-lm's streaming detokenizers, as the engine uses them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

TEXTS = [
    "Plain ASCII, with  double spaces and\nnewlines.",
    "Ünïcödé àccents, 日本語のテキスト, and emoji 🙂🚀👩‍👩‍👧 side by side.",
    "Numbers 1234567890 and symbols ∑∫√ — done.",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):  # type: ignore[no-untyped-def]
    return load_tokenizer(tiny_model)


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_never_hold_broken_characters_and_add_up(tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = tokenizer.detokenizer
    pieces = []
    for token in ids:
        detok.add_token(token)
        pieces.append(detok.last_segment)
    detok.finalize()
    pieces.append(detok.last_segment)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    if not text.isascii():  # multi-byte characters span tokens: those pieces wait for the rest
        assert "" in pieces[:-1]


def test_each_detokenizer_is_independent(tokenizer) -> None:  # type: ignore[no-untyped-def]
    a, b = tokenizer.detokenizer, tokenizer.detokenizer
    for token in tokenizer.encode("hello", add_special_tokens=False):
        a.add_token(token)
    a.finalize()
    b.finalize()
    assert a.text == "hello"
    assert b.text == ""
