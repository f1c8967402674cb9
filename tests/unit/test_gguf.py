"""GGUF header parsing, import refusals and tokenizer conversion, on tiny synthetic files."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from mlxd.engine.models.gguf import GGUFError, GGUFFile
from mlxd.engine.models.gguf_tokenizer import Vocab, build_tokenizer, special_tokens, tokenizer_json
from tests.gguf_files import (
    F32,
    I32,
    Q6_K,
    Q8_0,
    SPECIALS,
    U64,
    byte_level_vocab,
    encode_string,
    llama_metadata,
    write_gguf,
)


def test_header_metadata_and_tensor_infos(tmp_path: Path) -> None:
    meta = {
        **llama_metadata(),
        "test.negative": -7,
        "test.big": U64(1 << 40),
        "test.flag": True,
        "test.floats": [0.5, -1.25],
        "test.nested": [["a", "b"], ["c"]],
    }
    tensors = [("token_embd.weight", (12, 64), Q8_0, None), ("output_norm.weight", (8,), F32, None)]
    gguf = GGUFFile(write_gguf(tmp_path / "m.gguf", meta, tensors))
    assert gguf.version == 3
    assert gguf.architecture == "llama"
    assert gguf.arch_value("block_count") == 1
    assert gguf.get("test.negative") == -7
    assert gguf.get("test.big") == 1 << 40
    assert gguf.get("test.flag") is True
    assert gguf.get("test.floats") == [0.5, -1.25]
    assert gguf.get("test.nested") == [["a", "b"], ["c"]]
    embd = gguf.tensor("token_embd.weight")
    assert embd is not None and embd.shape == (12, 64) and embd.type_name == "Q8_0"
    assert [t.name for t in gguf.tensors] == ["token_embd.weight", "output_norm.weight"]
    assert gguf.data_offset % 32 == 0
    gguf.validate()


def test_version_2_is_read(tmp_path: Path) -> None:
    gguf = GGUFFile(write_gguf(tmp_path / "v2.gguf", llama_metadata(), version=2))
    assert gguf.version == 2


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"GGML" + bytes(60), "not a GGUF file"),
        (b"", "not a GGUF file"),
        (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "unsupported GGUF version 1"),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 5), "truncated"),
    ],
)
def test_malformed_files_are_refused(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError, match=message):
        GGUFFile(path)


def _raw_kv(key: str, vtype: int, payload: bytes) -> bytes:
    """One metadata entry, with a payload the writer would never produce."""
    return encode_string(key) + struct.pack("<I", vtype) + payload


def _nested_arrays(depth: int) -> bytes:
    """`depth` arrays of one array each, around an empty uint32 array."""
    return struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 4, 0)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (_raw_kv("huge.u32s", 9, struct.pack("<IQ", 4, 2**62)), "truncated"),
        (_raw_kv("huge.strings", 9, struct.pack("<IQ", 8, 2**62)), "truncated"),
        (_raw_kv("huge.arrays", 9, struct.pack("<IQ", 9, 2**62)), "truncated"),
        (_raw_kv("huge.string", 8, struct.pack("<Q", 2**63)), "truncated"),
        (_raw_kv("deep", 9, _nested_arrays(5000)), "nested deeper than 8"),
        (_raw_kv("bad.item", 9, struct.pack("<IQ", 77, 1)), "unknown GGUF array item type 77"),
        (_raw_kv("bad.utf8", 8, encode_string("x")[:8] + b"\xff"), "invalid UTF-8"),
    ],
    ids=["u32-count", "string-count", "array-count", "string-len", "deep", "item-type", "utf8"],
)
def test_hostile_metadata_is_refused(tmp_path: Path, entry: bytes, message: str) -> None:
    path = tmp_path / "hostile.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + entry + bytes(64))
    with pytest.raises(GGUFError, match=message):
        GGUFFile(path)


def test_nesting_up_to_the_cap_is_read(tmp_path: Path) -> None:
    path = tmp_path / "deep.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _raw_kv("deep", 9, _nested_arrays(8)))
    value = GGUFFile(path).get("deep")
    for _ in range(7):
        assert isinstance(value, list) and len(value) == 1
        value = value[0]
    assert value == []


@pytest.mark.parametrize("alignment", [0, 3, 48, I32(-32), "32", 32.0, True], ids=repr)
def test_bad_alignment_is_refused(tmp_path: Path, alignment: Any) -> None:
    path = write_gguf(tmp_path / "a.gguf", {**llama_metadata(), "general.alignment": alignment})
    with pytest.raises(GGUFError, match=r"general\.alignment=.* is not a positive power of two"):
        GGUFFile(path)


def test_custom_alignment_is_used(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "a.gguf", {**llama_metadata(), "general.alignment": 64})
    assert GGUFFile(path).data_offset % 64 == 0


@pytest.mark.parametrize(
    ("counts", "tail"),
    [
        ((2**62, 0), b""),  # tensor count
        ((0, 2**62), b""),  # metadata count
        ((1, 0), encode_string("t") + struct.pack("<I", 2**31)),  # a tensor with 2**31 dims
    ],
    ids=["tensors", "kvs", "dims"],
)
def test_hostile_counts_are_refused(tmp_path: Path, counts: tuple[int, int], tail: bytes) -> None:
    path = tmp_path / "counts.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, *counts) + tail + bytes(64))
    with pytest.raises(GGUFError, match=r"truncated|dims"):
        GGUFFile(path)


def test_leftover_parse_errors_become_gguf_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(tmp_path / "m.gguf", llama_metadata())

    def explode(*_args: Any) -> Any:
        raise struct.error("total struct size too long")

    monkeypatch.setattr("mlxd.engine.models.gguf._Cursor.unpack", explode)
    with pytest.raises(GGUFError, match=r"m\.gguf: malformed GGUF header \(error: total struct"):
        GGUFFile(path)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    gguf = GGUFFile(write_gguf(tmp_path / "q.gguf", llama_metadata("qwen2")))
    with pytest.raises(GGUFError, match="unsupported architecture 'qwen2'"):
        gguf.validate()


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    tensors = [("blk.0.ffn_down.weight", (8, 256), Q6_K, None)]
    gguf = GGUFFile(write_gguf(tmp_path / "k.gguf", llama_metadata(), tensors))
    with pytest.raises(GGUFError, match=r"tensor 'blk\.0\.ffn_down\.weight' has type Q6_K"):
        gguf.validate()


def _tokenizer(tmp_path: Path, pre: str = "smollm", **extra: Any) -> Any:
    meta = {**llama_metadata(), **byte_level_vocab(pre), **extra}
    return build_tokenizer(GGUFFile(write_gguf(tmp_path / "tok.gguf", meta)))


def test_smollm_splits_every_digit(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path, "smollm")
    # "12" is a merge in the vocab, but smollm isolates each digit before BPE runs.
    assert tok.encode("x 12").tokens == ["x", "Ġ", "1", "2"]
    assert tok.encode(" the").tokens == ["Ġthe"]


def test_gpt2_pre_tokenizer_keeps_digit_runs(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path, "gpt2")
    assert tok.encode("x 12").tokens == ["x", "Ġ", "12"]
    assert _tokenizer(tmp_path, "default").encode("12").tokens == ["12"]


def test_byte_level_round_trip_of_non_ascii(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path)
    text = "naïve café — 日本語 😀\n\ttabs  and spaces "
    assert tok.decode(tok.encode(text).ids) == text


def test_special_tokens_stay_whole(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path)
    ids = tok.encode("<|im_start|>the<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=True) == "the"


def test_llama3_pre_adds_bos_and_qwen2_splits_digits(tmp_path: Path) -> None:
    bos_meta = {"tokenizer.ggml.add_bos_token": True}
    assert _tokenizer(tmp_path, "llama-bpe", **bos_meta).encode("the").ids[0] == 1
    assert _tokenizer(tmp_path, "qwen2").encode("12").tokens == ["1", "2"]


def test_unknown_pre_tokenizer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match=r"unsupported pre-tokenizer tokenizer\.ggml\.pre='falcon'"):
        _tokenizer(tmp_path, "falcon")


def test_unknown_tokenizer_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match=r"tokenizer\.ggml\.model='bert'"):
        _tokenizer(tmp_path, **{"tokenizer.ggml.model": "bert"})


def spm_vocab() -> dict[str, Any]:
    """A tiny SentencePiece-style vocab: unk, bos, eos, 256 byte tokens, scored pieces."""
    pieces = {"▁": -1.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "▁h": -3.0, "ll": -3.5,
              "▁he": -4.0, "llo": -4.5, "▁hello": -5.0}  # fmt: skip
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + list(pieces.values()),
        "tokenizer.ggml.token_type": [I32(t) for t in [2, 3, 3] + [6] * 256 + [1] * len(pieces)],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def test_sentencepiece_vocab_merges_by_score_with_byte_fallback(tmp_path: Path) -> None:
    gguf = GGUFFile(write_gguf(tmp_path / "spm.gguf", {**llama_metadata(), **spm_vocab()}))
    tok = build_tokenizer(gguf)
    assert tok.encode("hello").tokens == ["<s>", "▁hello"]  # add_bos defaults on for llama
    assert tok.encode("hé").tokens == ["<s>", "▁h", "<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode("hello hé").ids, skip_special_tokens=True) == "hello hé"
    assert special_tokens(gguf, Vocab.from_gguf(gguf)).add_bos is True


def test_tokenizer_json_marks_control_tokens_special(tmp_path: Path) -> None:
    meta = {**llama_metadata(), **byte_level_vocab()}
    doc = tokenizer_json(GGUFFile(write_gguf(tmp_path / "t.gguf", meta)))
    assert [(t["content"], t["special"]) for t in doc["added_tokens"]] == [
        (s, True) for s in SPECIALS
    ]
