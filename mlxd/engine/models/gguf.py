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
# Fewest bytes one value of a type takes: bounds counts against the bytes left in the file.
_MIN_STRING_BYTES = 8  # the uint64 length
_MIN_ARRAY_BYTES = 12  # item type and count
MAX_ARRAY_DEPTH = 8  # real files nest at most 2; deeper is hostile (and would recurse)
MAX_TENSOR_DIMS = 4  # GGML_MAX_DIMS
# What a hostile header can still make the parser raise; GGUFFile reports these as GGUFError.
_PARSE_ERRORS = (
    struct.error, ValueError, OverflowError, UnicodeDecodeError, RecursionError, MemoryError,
)  # fmt: skip


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

    @property
    def num_left(self) -> int:
        """Bytes between the cursor and the end of the file."""
        return len(self.buf) - self.pos

    def check_fits(self, count: int, item_size: int, what: str) -> None:
        """GGUFError unless `count` items of `item_size`+ bytes fit in the rest of the file."""
        # Before struct.calcsize or a loop sees the count: 2**62 items must not get that far.
        if count * item_size > self.num_left:
            raise GGUFError(
                f"{self.path}: truncated GGUF header ({what}: {count} items of {item_size}+ bytes "
                f"at {self.pos}, {self.num_left} bytes left)"
            )

    def unpack_many(self, fmt: str, count: int) -> tuple[Any, ...]:
        self.check_fits(count, struct.calcsize(f"<{fmt}"), f"{fmt!r} values")
        spec = f"<{count}{fmt}"
        values = struct.unpack_from(spec, self.buf, self.pos)
        self.pos += struct.calcsize(spec)
        return values

    def string(self) -> str:
        length = self.unpack("Q")
        if length > self.num_left:
            raise GGUFError(f"{self.path}: truncated GGUF header (string of {length} bytes)")
        raw = self.buf[self.pos : self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: invalid UTF-8 in a GGUF string at {self.pos}") from e

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype == _TYPE_STRING:
            return self.string()
        if vtype == _TYPE_ARRAY:
            return self.array(depth + 1)
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise GGUFError(f"{self.path}: unknown GGUF metadata value type {vtype}")
        return self.unpack(fmt)

    def array(self, depth: int = 1) -> list[Any]:
        if depth > MAX_ARRAY_DEPTH:
            raise GGUFError(f"{self.path}: GGUF arrays nested deeper than {MAX_ARRAY_DEPTH}")
        item_type, count = self.unpack("I"), self.unpack("Q")
        fmt = _SCALAR_FORMATS.get(item_type)
        if fmt is not None:  # one struct call for numeric arrays: vocab scores are long
            return list(self.unpack_many(fmt, count))
        if item_type not in (_TYPE_STRING, _TYPE_ARRAY):
            raise GGUFError(f"{self.path}: unknown GGUF array item type {item_type}")
        min_size = _MIN_STRING_BYTES if item_type == _TYPE_STRING else _MIN_ARRAY_BYTES
        self.check_fits(count, min_size, "array")
        return [self.value(item_type, depth) for _ in range(count)]


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
            try:
                self._parse(_Cursor(buf, self.path))
            except GGUFError:
                raise
            except _PARSE_ERRORS as e:  # a hostile header the checks above missed: no traceback
                raise GGUFError(
                    f"{self.path}: malformed GGUF header ({type(e).__name__}: {e})"
                ) from e

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
        cur.check_fits(num_kv, _MIN_STRING_BYTES + 4 + 1, "metadata")  # key, type, 1-byte value
        for _ in range(num_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack("I"))
        cur.check_fits(num_tensors, _MIN_STRING_BYTES + 4 + 4 + 8, "tensor infos")
        self.tensors = [self._tensor_info(cur) for _ in range(num_tensors)]
        align = self._alignment()
        self.data_offset = -(-cur.pos // align) * align

    def _alignment(self) -> int:
        """`general.alignment`, which must be a positive power-of-two integer."""
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        is_int = isinstance(align, int) and not isinstance(align, bool)
        if not is_int or align <= 0 or align & (align - 1):
            raise GGUFError(
                f"{self.path}: general.alignment={align!r} is not a positive power of two"
            )
        return int(align)

    @staticmethod
    def _tensor_info(cur: _Cursor) -> TensorInfo:
        name = cur.string()
        num_dims = cur.unpack("I")
        if num_dims > MAX_TENSOR_DIMS:
            raise GGUFError(f"{cur.path}: tensor {name!r} has {num_dims} dims (most is 4)")
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
