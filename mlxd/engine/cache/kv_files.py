"""The SSD tier's files: one prompt-cache entry a file, in mlx-lm's prompt-cache format.

A file is what mlx-lm's `save_prompt_cache` writes, and `load_prompt_cache` reads it back: a
safetensors file holding every layer's cache state (arrays; scalars such as the offset as
0-d arrays), and in its metadata the cache classes, which entries are scalars, and mlxd's own
fields:

- `mlxd_format`: this layout's version;
- `mlxd_tokens`: the token ids the KV covers (base64 of little-endian uint32), so an index of
  the tier is rebuilt at start from the files' headers alone;
- `mlxd_trimmable`: "1" when the cache can be cut to serve a prefix of itself;
- `mlxd_base`, `mlxd_start` (a delta file, a generation checkpoint's): the file holding the KV
  of the first `mlxd_start` tokens; this file's arrays hold only the tokens after them;
- `mlxd_checksum`: xxh3-128 over the rest of the header (the other metadata, every tensor's
  name, dtype, shape and offsets) and the whole data section, checked before a file is
  restored: a torn, truncated or flipped file is never loaded.

This module is plain Python over bytes (no MLX): `tensors_of` on the GPU thread turns a cache
into host buffers, and the writer thread writes them. Writes are crash-safe: a temp file in
the same dir, fsync (F_FULLFSYNC on macOS, where fsync does not reach the platter), rename,
fsync of the dir. A file that exists under its final name is complete.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import json
import os
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

FORMAT = "1"
SUFFIX = ".safetensors"
TEMP_PREFIX = "tmp-"  # temp files: tmp-<name>.<random>.partial, deleted by a scan at start
TEMP_SUFFIX = ".partial"
# Past this a header is not ours (a token list of 4M tokens is ~22 MB of base64).
MAX_HEADER_BYTES = 64 * 1024 * 1024
CHECKSUM_CHARS = 32  # xxh3-128 in hex
WRITE_CHUNK = 8 * 1024 * 1024

# safetensors' dtype names for the dtypes a KV cache holds
DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "uint16": "U16", "int16": "I16", "uint32": "U32",
    "int32": "I32", "uint64": "U64", "int64": "I64", "float16": "F16", "bfloat16": "BF16",
    "float32": "F32", "float64": "F64",
}


class CorruptFile(Exception):
    """A cache file that must not be loaded (bad header, wrong checksum, truncated)."""


@dataclass(frozen=True, slots=True)
class Tensor:
    """One array as safetensors stores it: its name, dtype name, shape and C-order bytes."""

    name: str
    dtype: str  # safetensors' name, e.g. "BF16"
    shape: tuple[int, ...]
    data: memoryview  # bytes, C-contiguous


@dataclass(frozen=True, slots=True)
class Header:
    """What a file's header says: its metadata, tensor index, where its data section starts, its size."""

    metadata: dict[str, str]
    index: dict[str, Any]
    data_start: int
    data_size: int

    @property
    def tokens(self) -> list[int]:
        return decode_tokens(self.metadata.get("0.mlxd_tokens", ""))

    @property
    def trimmable(self) -> bool:
        """Whether its cache serves a prefix of itself (a sliding window that wrapped does not)."""
        return self.metadata.get("0.mlxd_trimmable", "1") == "1"

    @property
    def base(self) -> tuple[str, int] | None:
        """A delta file's base: the file holding the KV of its first tokens, and how many it
        holds them for (this file's arrays start there); None for a whole file."""
        name = self.metadata.get("0.mlxd_base")
        if name is None:
            return None
        try:
            start = int(self.metadata.get("0.mlxd_start", ""))
        except ValueError as exc:
            raise CorruptFile(f"bad delta start: {exc}") from exc
        if start <= 0 or "/" in name or not name.endswith(SUFFIX):
            raise CorruptFile("bad delta base")
        return name, start


def encode_tokens(tokens: Iterable[int]) -> str:
    ids = list(tokens)
    return base64.b64encode(struct.pack(f"<{len(ids)}I", *ids)).decode("ascii")


def decode_tokens(text: str) -> list[int]:
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise CorruptFile(f"token list is not base64: {exc}") from exc
    if len(raw) % 4:
        raise CorruptFile("token list is not whole uint32s")
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def checksum(metadata: dict[str, str], index: dict[str, Any], chunks: Iterable[bytes | memoryview]) -> str:
    """xxh3-128 of the header (metadata without the checksum itself, and the tensor index:
    name -> dtype, shape, offsets) and the data section's bytes."""
    h = _hasher(metadata, index)
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def _hasher(metadata: dict[str, str], index: dict[str, Any]) -> Any:
    """An xxh3-128 state fed the header's part of the checksum; the data goes in after it."""
    h = xxhash.xxh3_128()
    fields = {k: v for k, v in metadata.items() if k != "0.mlxd_checksum"}
    h.update(json.dumps([fields, index], sort_keys=True, separators=(",", ":")).encode())
    return h


def tensor_index(tensors: list[Tensor]) -> dict[str, Any]:
    """The header's entry for each tensor, laid out back to back in order."""
    index: dict[str, Any] = {}
    offset = 0
    for t in tensors:
        index[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.data.nbytes]}
        offset += t.data.nbytes
    return index


def build_header(tensors: list[Tensor], metadata: dict[str, str]) -> bytes:
    """The safetensors header (8-byte length, JSON padded to 8 bytes) for `tensors` in order."""
    entries: dict[str, Any] = {"__metadata__": metadata, **tensor_index(tensors)}
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def own_metadata(tokens: list[int], cache_meta: dict[str, str], trimmable: bool,
                 base: tuple[str, int] | None = None) -> dict[str, str]:
    """A file's metadata but its checksum: mlxd's fields (a delta file's base too) and mlx-lm's
    (`cache_meta`)."""
    meta = {"0.mlxd_format": FORMAT, "0.mlxd_tokens": encode_tokens(tokens),
            "0.mlxd_trimmable": "1" if trimmable else "0", **cache_meta}
    if base is not None:
        meta["0.mlxd_base"], meta["0.mlxd_start"] = base[0], str(base[1])
    return meta


def write_file(dir_: Path, name: str, tokens: list[int], cache_meta: dict[str, str], tensors: list[Tensor],
               pause: Any = None, trimmable: bool = True, base: tuple[str, int] | None = None) -> int:
    """Write `tensors` as `dir_/name` crash-safely; its size in bytes.

    One pass over the data: each chunk is hashed as it is written, behind a header of the
    final length (the checksum is fixed-width), and the real header goes in last. `pause`, if
    given, is called before every chunk (the writer waits there while the GPU is busy), so no
    stretch of reading the arrays outlasts one chunk. On any error the temp file is removed and
    the error raised; nothing under `name` changes.
    """
    meta = own_metadata(tokens, cache_meta, trimmable, base)
    index = tensor_index(tensors)
    digest = _hasher(meta, index)
    placeholder = build_header(tensors, {**meta, "0.mlxd_checksum": "0" * CHECKSUM_CHARS})
    temp = dir_ / f"{TEMP_PREFIX}{name}.{os.urandom(6).hex()}{TEMP_SUFFIX}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            _write_all(fd, placeholder)
            for t in tensors:
                for chunk in _chunks(t.data):
                    if pause is not None:
                        pause()
                    digest.update(chunk)
                    _write_all(fd, chunk)
            header = build_header(tensors, {**meta, "0.mlxd_checksum": digest.hexdigest()})
            assert len(header) == len(placeholder)
            _pwrite_all(fd, header, 0)
            full_fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, dir_ / name)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    fsync_dir(dir_)
    return len(placeholder) + sum(t.data.nbytes for t in tensors)


def _chunks(data: memoryview) -> Iterator[memoryview]:
    flat = data.cast("B") if data.ndim != 1 or data.format != "B" else data
    for start in range(0, flat.nbytes, WRITE_CHUNK):
        yield flat[start:start + WRITE_CHUNK]


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]


def full_fsync(fd: int) -> None:
    """Flush `fd` to stable storage: F_FULLFSYNC on macOS (fsync there stops at the drive's
    cache), fsync elsewhere or where the file system refuses F_FULLFSYNC."""
    if sys.platform == "darwin" and hasattr(fcntl, "F_FULLFSYNC"):
        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass
    os.fsync(fd)


def fsync_dir(dir_: Path) -> None:
    """Make a rename in `dir_` durable."""
    fd = os.open(dir_, os.O_RDONLY)
    try:
        full_fsync(fd)
    finally:
        os.close(fd)


def read_header(path: Path) -> Header:
    """Parse a file's header (cheap: the data section is not read); CorruptFile if it is not
    ours, FileNotFoundError if it is gone."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) != 8:
                raise CorruptFile("shorter than a header")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CorruptFile("header length out of range")
            text = f.read(n)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CorruptFile(f"unreadable: {exc}") from exc
    try:
        entries = json.loads(text)
        metadata = entries.pop("__metadata__")
        ends = [int(e["data_offsets"][1]) for e in entries.values()]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, OverflowError) as exc:
        raise CorruptFile(f"bad header: {exc}") from exc
    if not isinstance(metadata, dict) or metadata.get("0.mlxd_format") != FORMAT:
        raise CorruptFile("not an mlxd cache file of this format")
    data_size = max(ends, default=0)
    if 8 + n + data_size != size:
        raise CorruptFile(f"size {size} does not match its header ({8 + n + data_size})")
    return Header(metadata, entries, 8 + n, data_size)


def verify(path: Path) -> Header:
    """Read the whole file and check its checksum; its header, or CorruptFile."""
    header = read_header(path)
    try:
        with open(path, "rb") as f:
            f.seek(header.data_start)
            chunks = iter(lambda: f.read(WRITE_CHUNK), b"")
            digest = checksum(header.metadata, header.index, chunks)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CorruptFile(f"unreadable: {exc}") from exc
    if digest != header.metadata.get("0.mlxd_checksum"):
        raise CorruptFile("checksum mismatch")
    return header
