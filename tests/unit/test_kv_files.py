"""kv_files.py: the SSD tier's file format (mlx-lm's prompt-cache layout plus mlxd's fields), its
crash-safe writes, and the checks that keep a torn, truncated or flipped file from ever loading."""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, load_prompt_cache, save_prompt_cache

from mlxd.engine.cache import kv_files
from mlxd.engine.cache.kv_files import CorruptFile
from mlxd.engine.cache.kv_layout import host_tensors, stage, tensors_of, view

NAME = "entry.safetensors"
TOKENS = [1, 2, 3, 70_000, 5]


def make_kv(dtype: mx.Dtype = mx.bfloat16, layers: int = 2, n: int = 5, seed: int = 0) -> list[Any]:
    """`layers` KVCache layers holding `n` tokens of random (1, 2, n, 64) keys and values, cut to
    exactly `n` (as the prefix cache stores them)."""
    kv = []
    for i in range(layers):
        k1, k2 = mx.random.split(mx.random.key(seed * 100 + i))
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, n, 64), key=k1).astype(dtype),
                           mx.random.normal((1, 2, n, 64), key=k2).astype(dtype))
        kv.append(c)
    return view(kv, n)


def make_quantized_kv(bits: int, group_size: int, layers: int = 2, n: int = 5) -> list[Any]:
    kv = make_kv(mx.float16, layers, n, seed=7)
    return view([c.to_quantized(group_size=group_size, bits=bits) for c in kv], n)


def write(dir_: Path, kv: list[Any], tokens: list[int], name: str = NAME, **kw: Any) -> Path:
    meta, tensors, _owner = tensors_of(kv)
    size = kv_files.write_file(dir_, name, tokens, meta, tensors, **kw)
    path = dir_ / name
    assert path.stat().st_size == size
    return path


def arrays_equal(a: Any, b: Any) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b).item())


def leftovers(dir_: Path) -> list[str]:
    return sorted(p.name for p in dir_.iterdir())


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bfloat16", "float32", "q4", "q8"])
def test_like_arrays_staged_in_blocks_write_the_same_file_as_one_array_a_tensor(tmp_path: Path, kind: str) -> None:
    """On CUDA a cache is staged in blocks of like arrays (few host reads a file, not one a
    tensor: kv_layout.GROUP), each up to a size; the file is the same byte for byte, and loads
    with mlx-lm."""
    if kind.startswith("q"):
        kv = make_quantized_kv(bits=int(kind[1:]), group_size=32, layers=3, n=9)
    else:
        kv = make_kv(getattr(mx, kind), layers=3, n=9)
    files, blocks = [], []
    for group, block_bytes in ((False, None), (True, 1 << 30), (True, 2 * 9 * 64 * 4)):
        staged = stage(kv, group=group, block_bytes=block_bytes)
        mx.eval(staged.arrays)
        meta, tensors, _owner = host_tensors(staged)
        out = tmp_path / f"{group}-{block_bytes}"
        out.mkdir()
        kv_files.write_file(out, NAME, list(range(9)), meta, tensors)
        files.append((out / NAME).read_bytes())
        blocks.append(len(staged.blocks))
    assert files[0] == files[1] == files[2]
    # One array a tensor (3 layers' K, V and offset; a quantized K or V is 3 arrays). Then, with
    # room: a plain cache's K and V in one block, a quantized one's in two (data; scales and
    # biases), the offsets in one more. Then blocks of at most 4,608 bytes: two bfloat16 arrays
    # of 2 x 9 x 64 a block, one float32 array, never one split; q4's data (576 bytes an array)
    # all fit one, q8's (1,152) two.
    assert blocks == {"bfloat16": [9, 2, 4], "float32": [9, 2, 7], "q4": [27, 3, 3], "q8": [27, 3, 4]}[kind]
    loaded = load_prompt_cache(str(out / NAME))
    for got, want in zip(loaded, kv, strict=True):
        assert got.offset == want.offset == 9
        arrays = [[a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)] for c in (got, want)]
        assert len(arrays[0]) == len(arrays[1]) >= 2
        assert all(arrays_equal(a, b) for a, b in zip(*arrays, strict=True))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["float32", "float16", "bfloat16"])
def test_a_written_file_loads_with_mlx_lm_to_equal_arrays_and_offset(tmp_path: Path, dtype: mx.Dtype) -> None:
    kv = make_kv(dtype, layers=3, n=7)
    path = write(tmp_path, kv, list(range(7)))
    loaded, user_meta = load_prompt_cache(str(path), return_metadata=True)
    assert len(loaded) == 3
    for got, want in zip(loaded, kv, strict=True):
        assert type(got) is KVCache
        assert got.offset == 7
        assert arrays_equal(got.keys, want.keys)
        assert arrays_equal(got.values, want.values)
    # mlx-lm hands mlxd's own fields back as the user metadata
    assert user_meta["mlxd_format"] == kv_files.FORMAT
    assert kv_files.decode_tokens(user_meta["mlxd_tokens"]) == list(range(7))


@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (4, 64), (8, 64)])
def test_a_quantized_cache_round_trips_with_its_bits_and_group_size(tmp_path: Path, bits: int, group_size: int) -> None:
    kv = make_quantized_kv(bits, group_size, n=6)
    path = write(tmp_path, kv, list(range(6)))
    loaded = load_prompt_cache(str(path))
    assert [type(c) for c in loaded] == [QuantizedKVCache] * len(kv)
    for got, want in zip(loaded, kv, strict=True):
        assert (got.bits, got.group_size, got.offset) == (bits, group_size, 6)
        assert len(got.keys) == len(want.keys) == 3
        for g, w in zip((*got.keys, *got.values), (*want.keys, *want.values), strict=True):
            assert arrays_equal(g, w)


@pytest.mark.parametrize(
    "tokens",
    [
        [],
        [0],
        [65_535, 65_536, 2**31 - 1, 2**31, 2**32 - 1],
        np.random.default_rng(0).integers(0, 2**32, size=100_000, dtype=np.uint64).tolist(),
    ],
    ids=["empty", "zero", "above-16-bit", "100k-random-uint32"],
)
def test_tokens_survive_read_header_and_verify(tmp_path: Path, tokens: list[int]) -> None:
    path = write(tmp_path, make_kv(n=3), tokens)
    assert kv_files.read_header(path).tokens == tokens
    assert kv_files.verify(path).tokens == tokens


def test_an_empty_token_list_still_loads_with_mlx_lm(tmp_path: Path) -> None:
    kv = make_kv(n=2)
    path = write(tmp_path, kv, [])
    loaded = load_prompt_cache(str(path))
    assert [c.offset for c in loaded] == [2, 2]
    assert arrays_equal(loaded[0].keys, kv[0].keys)


def test_write_returns_the_size_and_the_header_describes_the_file(tmp_path: Path) -> None:
    kv = make_kv(n=4)
    meta, tensors, _owner = tensors_of(kv)
    size = kv_files.write_file(tmp_path, NAME, TOKENS, meta, tensors)
    path = tmp_path / NAME
    header = kv_files.verify(path)
    assert size == path.stat().st_size == header.data_start + header.data_size
    assert header.data_size == sum(t.data.nbytes for t in tensors)
    assert list(header.index) == [t.name for t in tensors]
    for t in tensors:
        assert header.index[t.name]["dtype"] == t.dtype
        assert tuple(header.index[t.name]["shape"]) == t.shape
    assert {k: header.metadata[k] for k in meta} == meta  # mlx-lm's fields, as given
    assert header.metadata["0.mlxd_format"] == kv_files.FORMAT
    assert (header.data_start - 8) % 8 == 0  # the JSON is padded to 8 bytes


def test_a_written_file_is_private_and_no_temp_file_is_left(tmp_path: Path) -> None:
    path = write(tmp_path, make_kv(), TOKENS)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert leftovers(tmp_path) == [NAME]


def test_pause_runs_before_every_chunk_and_chunking_does_not_change_the_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = make_kv(n=5)
    whole = write(tmp_path, kv, TOKENS, name="whole.safetensors").read_bytes()
    chunk = 100  # does not divide the tensors' sizes
    monkeypatch.setattr(kv_files, "WRITE_CHUNK", chunk)
    pauses: list[int] = []
    _meta, tensors, _owner = tensors_of(kv)
    chunked = write(tmp_path, kv, TOKENS, name="chunked.safetensors", pause=lambda: pauses.append(1))
    assert len(pauses) == sum(-(-t.data.nbytes // chunk) for t in tensors)
    assert chunked.read_bytes() == whole
    kv_files.verify(chunked)  # verify reads in (small) chunks too


def test_the_one_pass_write_puts_the_checksum_of_the_finished_data_in_its_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # write_file hashes each chunk as it writes it and puts the header in last; the header must
    # equal the one a separate pass over the finished arrays makes
    monkeypatch.setattr(kv_files, "WRITE_CHUNK", 1000)
    kv = make_kv(n=300)
    meta, tensors, _owner = tensors_of(kv)
    path = write(tmp_path, kv, [7, 8, 9])
    expected = kv_files.own_metadata([7, 8, 9], meta, True)
    expected["0.mlxd_checksum"] = kv_files.checksum(expected, kv_files.tensor_index(tensors), (t.data for t in tensors))
    assert kv_files.read_header(path).metadata == expected
    kv_files.verify(path)


def test_decode_tokens_refuses_a_partial_uint32() -> None:
    with pytest.raises(CorruptFile):
        kv_files.decode_tokens("AAA=")  # two bytes


# --- damage: flips, truncation, extra bytes ---------------------------------------------------


def sample_positions(path: Path) -> list[int]:
    """40 positions spread over the file, plus ones chosen in each part of it: the length
    prefix, the JSON (the token list, the checksum, the tensor index, the padding), the data."""
    raw = path.read_bytes()
    header = kv_files.read_header(path)
    text = raw[8:header.data_start]
    chosen = {0, 3, 7, 8, header.data_start - 1, header.data_start, header.data_start + 1, len(raw) - 1}
    chosen.add(8 + text.index(header.metadata["0.mlxd_tokens"].encode()) + 2)
    chosen.add(8 + text.index(header.metadata["0.mlxd_checksum"].encode()) + 5)
    chosen.add(8 + text.index(b'"data_offsets"') + 16)
    chosen.add(8 + text.rstrip(b" ").rindex(b"}"))  # the JSON's last brace
    chosen.update(int(p) for p in np.linspace(0, len(raw) - 1, 40))
    return sorted(chosen)


def test_every_single_bit_flip_at_sampled_positions_is_caught(tmp_path: Path) -> None:
    path = write(tmp_path, make_kv(mx.bfloat16, layers=2, n=5), TOKENS)
    raw = path.read_bytes()
    header = kv_files.read_header(path)
    positions = sample_positions(path)
    assert sum(p < header.data_start for p in positions) >= 10
    assert sum(p >= header.data_start for p in positions) >= 10
    damaged = tmp_path / "damaged.safetensors"
    missed = []
    for pos in positions:
        for bit in range(8):
            flipped = bytearray(raw)
            flipped[pos] ^= 1 << bit
            damaged.write_bytes(flipped)
            try:
                kv_files.verify(damaged)
            except CorruptFile:
                continue
            missed.append((pos, bit))
    assert missed == []
    kv_files.verify(path)  # and the original is fine


def test_a_flip_in_the_padding_is_caught(tmp_path: Path) -> None:
    # find token lists whose header needs padding, so the flip lands in it
    for extra in range(8):
        path = write(tmp_path, make_kv(n=2), list(range(extra)), name=f"p{extra}.safetensors")
        header = kv_files.read_header(path)
        raw = path.read_bytes()
        if raw[header.data_start - 1:header.data_start] == b" ":
            break
    else:
        pytest.fail("no token list needed padding")
    flipped = bytearray(raw)
    flipped[header.data_start - 1] ^= 0x01
    path.write_bytes(flipped)
    with pytest.raises(CorruptFile):
        kv_files.verify(path)


TRUNCATIONS: dict[str, Callable[[int, int], int]] = {
    "empty": lambda start, size: 0,
    "4 bytes": lambda start, size: 4,
    "length prefix only": lambda start, size: 8,
    "mid-header": lambda start, size: start // 2,
    "header only": lambda start, size: start,
    "mid-data": lambda start, size: (start + size) // 2,
    "one byte short": lambda start, size: size - 1,
}


@pytest.mark.parametrize("cut", list(TRUNCATIONS))
def test_a_truncated_file_is_refused(tmp_path: Path, cut: str) -> None:
    path = write(tmp_path, make_kv(), TOKENS)
    header = kv_files.read_header(path)
    raw = path.read_bytes()
    length = TRUNCATIONS[cut](header.data_start, len(raw))
    assert 0 <= length < len(raw)
    path.write_bytes(raw[:length])
    with pytest.raises(CorruptFile):
        kv_files.read_header(path)
    with pytest.raises(CorruptFile):
        kv_files.verify(path)


@pytest.mark.parametrize("extra", [b"\0", b" ", b"x" * 8, b"\0" * 4096])
def test_extra_trailing_bytes_are_refused(tmp_path: Path, extra: bytes) -> None:
    path = write(tmp_path, make_kv(), TOKENS)
    with open(path, "ab") as f:
        f.write(extra)
    with pytest.raises(CorruptFile):
        kv_files.verify(path)


def test_a_missing_file_is_gone_not_corrupt(tmp_path: Path) -> None:
    # the tier drops a vanished file from its index without counting it as damaged
    with pytest.raises(FileNotFoundError):
        kv_files.read_header(tmp_path / "nothing.safetensors")
    with pytest.raises(FileNotFoundError):
        kv_files.verify(tmp_path / "nothing.safetensors")


# --- files that are not ours -------------------------------------------------------------------


def test_a_prompt_cache_saved_by_mlx_lm_itself_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "mlx-lm.safetensors"
    save_prompt_cache(str(path), make_kv(), {"note": "not mlxd's"})
    assert load_prompt_cache(str(path))  # valid safetensors, valid prompt cache...
    with pytest.raises(CorruptFile, match="not an mlxd cache file"):
        kv_files.read_header(path)  # ...but not ours


def test_a_safetensors_file_without_metadata_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    mx.save_safetensors(str(path), {"x": mx.zeros((2, 3))})
    with pytest.raises(CorruptFile):
        kv_files.read_header(path)


def test_a_file_of_another_format_version_is_refused(tmp_path: Path) -> None:
    meta, tensors, _owner = tensors_of(make_kv())
    kv_files.write_file(tmp_path, NAME, TOKENS, {**meta, "0.mlxd_format": "2"}, tensors)
    with pytest.raises(CorruptFile, match="not an mlxd cache file"):
        kv_files.read_header(tmp_path / NAME)


def raw_file(path: Path, header_text: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header_text)) + header_text + data)
    return path


@pytest.mark.parametrize(
    "header_text",
    [
        b"[]",
        b"null",
        b"42",
        b'{"__metadata__":[]}',
        b'{"__metadata__":{"0.mlxd_format":"1"},"x":"y"}',
        b'{"__metadata__":{"0.mlxd_format":"1"},"x":{"dtype":"F32"}}',
        b'{"__metadata__":{"0.mlxd_format":"1"},"x":{"data_offsets":[0]}}',
        b'{"__metadata__":{"0.mlxd_format":"1"},"x":{"data_offsets":[0,"four"]}}',
        b'{"__metadata__":{"0.mlxd_format":"1"},"x":{"data_offsets":[0,null]}}',
        b"\xff\xfe not json",
    ],
    ids=["list", "null", "number", "metadata-list", "entry-string", "no-offsets", "short-offsets",
         "string-offset", "null-offset", "not-utf8"],
)
def test_headers_that_are_not_ours_are_refused(tmp_path: Path, header_text: bytes) -> None:
    with pytest.raises(CorruptFile):
        kv_files.read_header(raw_file(tmp_path / "odd.safetensors", header_text, b"\0" * 4))


def test_a_header_length_past_the_limit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", kv_files.MAX_HEADER_BYTES + 1) + b" " * 64)
    with pytest.raises(CorruptFile, match="out of range"):
        kv_files.read_header(path)


def test_a_header_with_an_infinite_offset_is_refused(tmp_path: Path) -> None:
    text = b'{"__metadata__":{"0.mlxd_format":"1"},"x":{"dtype":"F32","shape":[1],"data_offsets":[0,1e999]}}'
    with pytest.raises(CorruptFile):
        kv_files.read_header(raw_file(tmp_path / "inf.safetensors", text, b"\0" * 4))


def test_a_token_field_flipped_out_of_base64_is_corrupt(tmp_path: Path) -> None:
    path = write(tmp_path, make_kv(), [1, 2, 3])
    raw = path.read_bytes()
    at = raw.index(kv_files.encode_tokens([1, 2, 3]).encode())
    assert raw[at:at + 1] == b"A"
    flipped = bytearray(raw)
    flipped[at] ^= 0x01  # 'A' -> '@': still a valid JSON string, not base64
    path.write_bytes(flipped)
    with pytest.raises(CorruptFile):
        kv_files.verify(path)  # the checksum catches it...
    header = kv_files.read_header(path)  # ...read_header alone does not look at the tokens
    with pytest.raises(CorruptFile):
        _ = header.tokens


# --- failed writes leave nothing behind --------------------------------------------------------


def test_a_pause_that_raises_leaves_no_temp_file_and_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_files, "WRITE_CHUNK", 256)
    calls = 0

    def pause() -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        write(tmp_path, make_kv(), TOKENS, pause=pause)
    assert calls == 3
    assert leftovers(tmp_path) == []


def test_a_failed_rename_leaves_no_temp_file_and_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    replaced: list[tuple[str, str]] = []

    def refuse(src: Any, dst: Any) -> None:
        replaced.append((Path(src).name, Path(dst).name))
        raise OSError(errno.EIO, "rename failed")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="rename failed"):
        write(tmp_path, make_kv(), TOKENS)
    assert len(replaced) == 1
    src, dst = replaced[0]
    assert src.startswith(kv_files.TEMP_PREFIX + NAME) and src.endswith(kv_files.TEMP_SUFFIX)
    assert dst == NAME
    assert leftovers(tmp_path) == []


def test_a_disk_full_mid_write_keeps_the_old_file_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, make_kv(seed=1), [9, 9])
    before = path.read_bytes()
    real = kv_files._write_all
    writes = 0

    def full(fd: int, data: bytes | memoryview) -> None:
        nonlocal writes
        writes += 1
        if writes == 2:  # the header went through; the first chunk of data does not
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(kv_files, "_write_all", full)
    with pytest.raises(OSError) as info:
        write(tmp_path, make_kv(seed=2), TOKENS)
    assert info.value.errno == errno.ENOSPC
    assert leftovers(tmp_path) == [NAME]
    assert path.read_bytes() == before  # nothing under the name changed
    assert kv_files.verify(path).tokens == [9, 9]


# --- fsync ---------------------------------------------------------------------------------------


class FakeFcntl:
    """Stands in for the fcntl module: records calls, optionally refuses F_FULLFSYNC."""

    F_FULLFSYNC = 51

    def __init__(self, refuse: bool = False) -> None:
        self.calls: list[tuple[int, int]] = []
        self.refuse = refuse

    def fcntl(self, fd: int, cmd: int) -> int:
        self.calls.append((fd, cmd))
        if self.refuse:
            raise OSError(errno.ENOTSUP, "F_FULLFSYNC not supported")
        return 0


@pytest.fixture()
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(os, "fsync", calls.append)
    return calls


def test_full_fsync_on_linux_calls_fsync(monkeypatch: pytest.MonkeyPatch, fsyncs: list[int]) -> None:
    fake = FakeFcntl()
    monkeypatch.setattr(kv_files, "sys", SimpleNamespace(platform="linux"))
    monkeypatch.setattr(kv_files, "fcntl", fake)
    kv_files.full_fsync(17)
    assert fsyncs == [17]
    assert fake.calls == []  # F_FULLFSYNC is for macOS only


def test_full_fsync_on_macos_uses_f_fullfsync(monkeypatch: pytest.MonkeyPatch, fsyncs: list[int]) -> None:
    fake = FakeFcntl()
    monkeypatch.setattr(kv_files, "sys", SimpleNamespace(platform="darwin"))
    monkeypatch.setattr(kv_files, "fcntl", fake)
    kv_files.full_fsync(17)
    assert fake.calls == [(17, FakeFcntl.F_FULLFSYNC)]
    assert fsyncs == []


def test_full_fsync_on_macos_falls_back_to_fsync_when_refused(
    monkeypatch: pytest.MonkeyPatch, fsyncs: list[int]
) -> None:
    fake = FakeFcntl(refuse=True)
    monkeypatch.setattr(kv_files, "sys", SimpleNamespace(platform="darwin"))
    monkeypatch.setattr(kv_files, "fcntl", fake)
    kv_files.full_fsync(17)
    assert fake.calls == [(17, FakeFcntl.F_FULLFSYNC)]
    assert fsyncs == [17]


def test_full_fsync_on_macos_without_f_fullfsync_calls_fsync(
    monkeypatch: pytest.MonkeyPatch, fsyncs: list[int]
) -> None:
    fake_calls: list[tuple[int, int]] = []
    monkeypatch.setattr(kv_files, "sys", SimpleNamespace(platform="darwin"))
    monkeypatch.setattr(kv_files, "fcntl", SimpleNamespace(fcntl=lambda fd, cmd: fake_calls.append((fd, cmd))))
    kv_files.full_fsync(17)
    assert fsyncs == [17]
    assert fake_calls == []


def test_write_fsyncs_the_file_before_the_rename_and_the_dir_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(kv_files, "sys", SimpleNamespace(platform="linux"))
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write(tmp_path, make_kv(), TOKENS)
    assert events == ["fsync file", "rename", "fsync dir"]


def test_checksum_covers_the_tensor_index_not_just_the_bytes() -> None:
    data = memoryview(bytes(range(16)))
    a = [kv_files.Tensor("a", "F32", (4,), data)]
    b = [kv_files.Tensor("a", "F32", (2, 2), data)]  # same bytes, other shape
    meta = {"0.mlxd_format": "1"}
    sum_a = kv_files.checksum(meta, kv_files.tensor_index(a), [data])
    assert sum_a != kv_files.checksum(meta, kv_files.tensor_index(b), [data])
    assert sum_a == kv_files.checksum({**meta, "0.mlxd_checksum": "anything"}, kv_files.tensor_index(a), [data])
    assert json.loads(json.dumps(kv_files.tensor_index(a)))["a"]["data_offsets"] == [0, 16]
