"""A pure-Python GGUF header reader: metadata, tensor infos, and the checks mlxd's importer needs."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# ggml tensor type ids, from ggml.h; only the names matter here (for messages).
GGML_TYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip
# What mx.load can read from a GGUF and the importer can convert.
SUPPORTED_TENSOR_TYPES = frozenset({"F32", "F16", "Q4_0", "Q4_1", "Q8_0"})
SUPPORTED_ARCHITECTURES = frozenset({"llama"})

# GGUF metadata value types -> struct format of one scalar.
_SCALAR_FORMATS: dict[int, str] = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip
_TYPE_STRING = 8
_TYPE_ARRAY = 9


class GGUFError(ValueError):
    """A GGUF file that is malformed or that mlxd cannot import."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry; `shape` is row-major (GGUF stores dims innermost first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int

    @property
    def type_name(self) -> str:
        """The ggml type's name, e.g. "Q4_1", or "type N" for an unknown id."""
        return GGML_TYPE_NAMES.get(self.ggml_type, f"type {self.ggml_type}")


class _Cursor:
    """Sequential little-endian reads over a buffer, raising GGUFError past its end."""

    def __init__(self, buf: bytes | mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def unpack(self, fmt: str) -> Any:
        return self.unpack_many(fmt, 1)[0]

    def unpack_many(self, fmt: str, count: int) -> tuple[Any, ...]:
        spec = f"<{count}{fmt}"
        size = struct.calcsize(spec)
        if self.pos + size > len(self.buf):
            raise GGUFError(
                f"{self.path}: truncated GGUF header (wanted {size} bytes at {self.pos})"
            )
        values = struct.unpack_from(spec, self.buf, self.pos)
        self.pos += size
        return values

    def string(self) -> str:
        length = self.unpack("Q")
        if self.pos + length > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header (string of {length} bytes)")
        raw = self.buf[self.pos : self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: invalid UTF-8 in a GGUF string at {self.pos}") from e

    def value(self, vtype: int) -> Any:
        if vtype == _TYPE_STRING:
            return self.string()
        if vtype == _TYPE_ARRAY:
            return self.array()
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise GGUFError(f"{self.path}: unknown GGUF metadata value type {vtype}")
        return self.unpack(fmt)

    def array(self) -> list[Any]:
        item_type, count = self.unpack("I"), self.unpack("Q")
        fmt = _SCALAR_FORMATS.get(item_type)
        if fmt is not None:  # one struct call for numeric arrays: vocab scores are long
            return list(self.unpack_many(fmt, count))
        return [self.value(item_type) for _ in range(count)]


class GGUFFile:
    """The parsed header of a GGUF file: version, metadata and tensor infos (no tensor data)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.version = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: list[TensorInfo] = []
        self.data_offset = 0
        if self.path.stat().st_size < 8:  # mmap refuses empty files; say what it is instead
            raise GGUFError(f"{self.path}: not a GGUF file (too short)")
        with self.path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            self._parse(_Cursor(buf, self.path))

    def _parse(self, cur: _Cursor) -> None:
        magic = bytes(cur.buf[:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        cur.pos = 4
        self.version = cur.unpack("I")
        if self.version not in SUPPORTED_VERSIONS:
            raise GGUFError(
                f"{self.path}: unsupported GGUF version {self.version} "
                "(supported: 2, 3; big-endian files are not supported)"
            )
        num_tensors, num_kv = cur.unpack("Q"), cur.unpack("Q")
        for _ in range(num_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack("I"))
        self.tensors = [self._tensor_info(cur) for _ in range(num_tensors)]
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_offset = -(-cur.pos // align) * align

    @staticmethod
    def _tensor_info(cur: _Cursor) -> TensorInfo:
        name = cur.string()
        num_dims = cur.unpack("I")
        dims = cur.unpack_many("Q", num_dims)
        ggml_type, offset = cur.unpack("I"), cur.unpack("Q")
        return TensorInfo(name, tuple(reversed(dims)), ggml_type, offset)

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or `default` when the key is absent."""
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        """A metadata value that must be present; GGUFError naming the key otherwise."""
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return self.metadata[key]

    @property
    def architecture(self) -> str:
        """`general.architecture`, e.g. "llama"."""
        return str(self.get("general.architecture", ""))

    def arch_value(self, suffix: str, default: Any = None) -> Any:
        """An architecture-scoped value, e.g. `arch_value("block_count")` -> `llama.block_count`."""
        return self.get(f"{self.architecture}.{suffix}", default)

    def tensor(self, name: str) -> TensorInfo | None:
        """The tensor info named `name` (e.g. "token_embd.weight"), if any."""
        return next((t for t in self.tensors if t.name == name), None)

    def validate(self) -> None:
        """Raise GGUFError unless the architecture and every tensor type can be imported."""
        arch = self.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(
                f"{self.path}: unsupported architecture {arch or '(none)'!r}; "
                f"only {', '.join(sorted(SUPPORTED_ARCHITECTURES))} GGUF files can be imported"
            )
        for info in self.tensors:
            if info.type_name not in SUPPORTED_TENSOR_TYPES:
                raise GGUFError(
                    f"{self.path}: tensor {info.name!r} has type {info.type_name}, which cannot "
                    f"be imported (supported: {', '.join(sorted(SUPPORTED_TENSOR_TYPES))})"
                )
