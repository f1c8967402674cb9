"""kv_arrays.py: a tier file read back in one pass (checksum checked while its arrays fill)
rebuilds the same cache mlx-lm's own `load_prompt_cache` does; kv_files' one-pass write puts
the same checksum in the header as hashing the finished arrays would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, load_prompt_cache

from mlxd.engine.cache import kv_files
from mlxd.engine.cache.kv_arrays import load_cache
from mlxd.engine.cache.kv_files import CorruptFile
from mlxd.engine.cache.prefix_cache import tensors_of, view


def kv_cache(dtype: mx.Dtype, n: int = 9, layers: int = 2) -> list[Any]:
    kv = []
    for i in range(layers):
        c = KVCache()
        k1, k2 = mx.random.split(mx.random.key(i))
        c.update_and_fetch(mx.random.normal((1, 2, n, 32), key=k1).astype(dtype),
                           mx.random.normal((1, 2, n, 32), key=k2).astype(dtype))
        kv.append(c)
    return view(kv, n)


def rotating_cache() -> list[Any]:
    c = RotatingKVCache(max_size=4, keep=1)
    for i in range(6):  # wraps around: its state has a meta_state of ints
        c.update_and_fetch(mx.full((1, 1, 1, 8), float(i)), mx.full((1, 1, 1, 8), float(-i)))
    return [c]


def write(tmp: Path, kv: list[Any], tokens: list[int], **kw: Any) -> Path:
    meta, tensors, _owner = tensors_of(kv)
    kv_files.write_file(tmp, "e.safetensors", tokens, meta, tensors, **kw)
    return tmp / "e.safetensors"


def same_state(a: Any, b: Any) -> None:
    sa, sb = a.state, b.state
    assert type(a) is type(b)
    assert _scalars(sa) == _scalars(sb)  # offsets, bits, group sizes, a rotating cache's fields
    for x, y in zip(_arrays(sa), _arrays(sb), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert bool(mx.array_equal(x, y).item())


def _scalars(state: Any) -> list[Any]:
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(state) if not isinstance(v, mx.array)]


def _arrays(state: Any) -> list[mx.array]:
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(state) if isinstance(v, mx.array)]


@pytest.mark.parametrize("make", [
    lambda: kv_cache(mx.bfloat16), lambda: kv_cache(mx.float16), lambda: kv_cache(mx.float32),
    lambda: view([c.to_quantized(group_size=32, bits=8) for c in kv_cache(mx.float16)], 9),
    lambda: view([c.to_quantized(group_size=32, bits=4) for c in kv_cache(mx.bfloat16)], 9),
    rotating_cache,
], ids=["bf16", "f16", "f32", "q8", "q4", "rotating"])
def test_load_cache_rebuilds_what_mlx_lm_loads(tmp_path: Path, make: Any) -> None:
    kv = make()
    path = write(tmp_path, kv, list(range(9)))
    ours, theirs = load_cache(path), load_prompt_cache(str(path))
    assert len(ours) == len(theirs) == len(kv)
    for a, b, original in zip(ours, theirs, kv, strict=True):
        same_state(a, b)
        same_state(a, original)
        assert a.offset == original.offset


def test_the_one_pass_write_puts_the_checksum_of_the_finished_file_in_its_header(tmp_path: Path) -> None:
    kv = kv_cache(mx.bfloat16, n=300)
    meta, tensors, _owner = tensors_of(kv)
    pauses: list[int] = []
    path = write(tmp_path, kv, [7, 8, 9], pause=lambda: pauses.append(1))
    assert pauses  # the writer could wait before hashing and writing each chunk
    header = kv_files.read_header(path)
    assert header.metadata == kv_files.file_metadata([7, 8, 9], meta, tensors)  # a second, separate pass
    kv_files.verify(path)


def test_load_cache_refuses_a_flipped_byte_in_the_last_tensor(tmp_path: Path) -> None:
    path = write(tmp_path, kv_cache(mx.bfloat16), [1])
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptFile, match="checksum"):
        load_cache(path)


def test_load_cache_refuses_a_file_whose_class_mlx_lm_does_not_have(tmp_path: Path) -> None:
    meta, tensors, _owner = tensors_of(kv_cache(mx.float16, layers=1))
    kv_files.write_file(tmp_path, "e.safetensors", [1], {**meta, "1.0": "os"}, tensors)  # a module, not a cache
    with pytest.raises(CorruptFile, match="unknown cache class"):
        load_cache(tmp_path / "e.safetensors")


def test_read_verified_refuses_tensors_that_leave_a_gap(tmp_path: Path) -> None:
    kv = kv_cache(mx.float16, layers=1)
    meta, tensors, _owner = tensors_of(kv)
    index = kv_files.tensor_index(tensors)
    first = next(iter(index))
    index[first]["data_offsets"][0] += 2  # a gap before the first tensor; the checksum is made to fit
    path = tmp_path / "gap.safetensors"
    metadata = kv_files.file_metadata([1], meta, tensors)
    metadata["0.mlxd_checksum"] = kv_files.checksum(metadata, index, (t.data for t in tensors))
    text = json.dumps({"__metadata__": metadata, **index}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(bytes(t.data) for t in tensors))
    with pytest.raises(CorruptFile, match="do not tile"):
        kv_files.read_verified(path)
