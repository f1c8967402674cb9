"""Tiny synthetic GGUF files for the tests: a writer, a byte-level BPE vocabulary, llama
hyperparameters, and a one-layer F32 llama laid out as llama.cpp writes it."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# ggml type id -> (bytes per block, elements per block), for sizing tensor data.
_BLOCKS = {0: (4, 1), 1: (2, 1), 2: (18, 32), 3: (20, 32), 8: (34, 32), 14: (210, 256)}
F32, F16, Q4_0, Q4_1, Q8_0, Q6_K = 0, 1, 2, 3, 8, 14


class U64(int):
    """An int the writer stores as uint64 (the default is uint32, or int32 when negative)."""


class I32(int):
    """An int the writer stores as int32 (llama.cpp wants token types as int32)."""


def encode_string(s: str) -> bytes:
    """A GGUF string: its UTF-8 length as uint64, then the bytes."""
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _typed(value: Any) -> tuple[int, bytes]:
    """(GGUF value type, encoded payload) for a Python value."""
    if isinstance(value, bool):
        return 7, struct.pack("<?", value)
    if isinstance(value, U64):
        return 10, struct.pack("<Q", value)
    if isinstance(value, I32):
        return 5, struct.pack("<i", value)
    if isinstance(value, int):
        return (4, struct.pack("<I", value)) if value >= 0 else (5, struct.pack("<i", value))
    if isinstance(value, float):
        return 6, struct.pack("<f", value)
    if isinstance(value, str):
        return 8, encode_string(value)
    item_type = _typed(value[0])[0] if value else 4
    items = b"".join(_typed(v)[1] for v in value)
    return 9, struct.pack("<IQ", item_type, len(value)) + items


def write_gguf(
    path: Path,
    metadata: dict[str, Any],
    tensors: Sequence[tuple[str, tuple[int, ...], int, bytes | None]] = (),
    *,
    magic: bytes = b"GGUF",
    version: int = 3,
) -> Path:
    """Write a GGUF file; tensor shapes are row-major, data defaults to zeros of the right size."""
    out = [magic, struct.pack("<IQQ", version, len(tensors), len(metadata))]
    for key, value in metadata.items():
        vtype, payload = _typed(value)
        out += [encode_string(key), struct.pack("<I", vtype), payload]
    blobs, offset = [], 0
    for name, shape, ggml_type, data in tensors:
        size, per = _BLOCKS[ggml_type]
        count = 1
        for dim in shape:
            count *= dim
        blob = data if data is not None else bytes(count // per * size)
        out += [encode_string(name), struct.pack("<I", len(shape))]
        out += [struct.pack("<Q", d) for d in reversed(shape)]  # GGUF lists dims innermost first
        out.append(struct.pack("<IQ", ggml_type, offset))
        pad = -len(blob) % 32
        blobs.append(blob + bytes(pad))
        offset += len(blob) + pad
    header = b"".join(out)
    path.write_bytes(header + bytes(-len(header) % 32) + b"".join(blobs))
    return path


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_vocab(pre: str = "smollm") -> dict[str, Any]:
    """Tokenizer metadata for a tiny byte-level BPE: 3 specials, 256 bytes, a few merges."""
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "Ġ 1"]
    tokens = [*SPECIALS, *_bytes_to_unicode().values(), "Ġt", "he", "Ġthe", "12", "Ġ1"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [I32(t) for t in types],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{{ messages[0]['content'] }}",
    }


def llama_metadata(arch: str = "llama") -> dict[str, Any]:
    """Model hyperparameters of a tiny llama."""
    return {
        "general.architecture": arch,
        "general.name": "tiny",
        f"{arch}.block_count": 1,
        f"{arch}.context_length": 64,
        f"{arch}.embedding_length": 8,
        f"{arch}.feed_forward_length": 16,
        f"{arch}.attention.head_count": 2,
        f"{arch}.attention.head_count_kv": 1,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": 10000.0,
    }


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows (the layout to undo)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def tiny_llama(path: Path, q: np.ndarray, k: np.ndarray) -> Path:
    """A one-layer F32 llama whose q/k rows are stored the way llama.cpp stores them."""
    rng = np.random.default_rng(0)
    meta = {**llama_metadata(), **byte_level_vocab()}
    vocab = len(meta["tokenizer.ggml.tokens"])

    def f32(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    arrays = {
        "token_embd.weight": f32(vocab, 8),
        "blk.0.attn_q.weight": llama_cpp_permute(q, 2),
        "blk.0.attn_k.weight": llama_cpp_permute(k, 1),
        "blk.0.attn_v.weight": f32(4, 8),
        "blk.0.attn_output.weight": f32(8, 8),
        "blk.0.ffn_gate.weight": f32(16, 8),
        "blk.0.ffn_up.weight": f32(16, 8),
        "blk.0.ffn_down.weight": f32(8, 16),
        "blk.0.attn_norm.weight": f32(8),
        "blk.0.ffn_norm.weight": f32(8),
        "output_norm.weight": f32(8),
    }
    tensors = [(n, a.shape, F32, a.tobytes()) for n, a in arrays.items()]
    return write_gguf(path, meta, tensors)


def tiny_llama_file(tmp_path: Path) -> Path:
    """tiny_llama at tmp_path/tiny.gguf, with identity-like q and k."""
    return tiny_llama(
        tmp_path / "tiny.gguf", np.eye(8, dtype=np.float32), np.eye(4, 8, dtype=np.float32)
    )
