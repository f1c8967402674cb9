"""ssd_tier.py: the SSD tier's index (rebuilt by a scan at start), quarantine, LRU eviction and
checked restores, and the writer thread (write-behind waits for an idle GPU; urgent writes and
flushes do not; I/O errors are counted and serving goes on)."""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlxd.engine.cache import kv_files, ssd_tier
from mlxd.engine.cache.kv_layout import tensors_of, view
from mlxd.engine.cache.ssd_tier import (
    QUARANTINE,
    QUARANTINE_KEEP,
    DiskEntry,
    SsdTier,
    WriteJob,
    Writer,
)
from tests.support import wait_for

BIG_CAP = 1 << 30
TIMEOUT_S = 10.0
CHUNK = 256  # small write chunks, so a write pauses many times


def make_kv(n: int = 5, layers: int = 2, seed: int = 0) -> list[Any]:
    """`layers` bf16 KVCache layers of exactly `n` random (1, 2, n, 64) tokens."""
    kv = []
    for i in range(layers):
        k1, k2 = mx.random.split(mx.random.key(seed * 100 + i))
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, n, 64), key=k1).astype(mx.bfloat16),
                           mx.random.normal((1, 2, n, 64), key=k2).astype(mx.bfloat16))
        kv.append(c)
    return view(kv, n)


def write_entry(dir_: Path, name: str, tokens: list[int], seed: int = 0) -> int:
    """A good file written the way the writer writes it; its size."""
    dir_.mkdir(parents=True, exist_ok=True)
    meta, tensors, _owner = tensors_of(make_kv(n=len(tokens) or 1, seed=seed))
    return kv_files.write_file(dir_, name, tokens, meta, tensors)


def make_job(name: str, tokens: list[int], urgent: bool, done: Callable[[bool], None], seed: int = 0) -> WriteJob:
    kv = make_kv(n=len(tokens), seed=seed)
    meta, tensors, owner = tensors_of(kv)
    nbytes = sum(t.data.nbytes for t in tensors)
    return WriteJob(name, np.asarray(tokens, dtype=np.int32), meta, tensors, urgent, owner, done, nbytes)


def set_mtime(path: Path, t: float) -> None:
    os.utime(path, (t, t))


def quarantined(dir_: Path) -> list[str]:
    """The original names of the files in quarantine/ (their names are `<time>-<name>`)."""
    qdir = dir_ / QUARANTINE
    if not qdir.exists():
        return []
    return sorted(p.name.split("-", 1)[1] for p in qdir.iterdir())


def temp_files(dir_: Path) -> list[Path]:
    return [p for p in dir_.iterdir() if p.name.startswith(kv_files.TEMP_PREFIX)]


def flip_bit(path: Path, pos: int, bit: int = 0) -> None:
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 1 << bit
    path.write_bytes(raw)


class Done:
    """A job's `done` callback: records the results, and lets a test wait for them."""

    def __init__(self) -> None:
        self.results: list[bool] = []
        self.event = threading.Event()

    def __call__(self, ok: bool) -> None:
        self.results.append(ok)
        self.event.set()

    def wait(self) -> list[bool]:
        assert self.event.wait(TIMEOUT_S), "the writer did not finish the job"
        return self.results


class CountingIdle(threading.Event):
    """The GPU loop's idle flag, counting how often the writer looks at it."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def is_set(self) -> bool:
        self.checks += 1
        return super().is_set()


class BusyAfter(CountingIdle):
    """Idle for the first `n` looks, then busy (cleared) until a test sets it again."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n
        self.set()

    def is_set(self) -> bool:
        if self.left == 0:
            self.clear()
        self.left -= 1
        return super().is_set()


@contextlib.contextmanager
def running_writer(tier: SsdTier, idle: threading.Event) -> Iterator[Writer]:
    writer = Writer(tier, idle)
    try:
        yield writer
    finally:
        idle.set()  # let a paused job go, so the thread can end
        writer.stop()
        writer._thread.join(TIMEOUT_S)
        assert not writer._thread.is_alive()


@pytest.fixture()
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(kv_files, "WRITE_CHUNK", CHUNK)
    return CHUNK


# --- the scan at start -----------------------------------------------------------------------


def test_the_scan_deletes_temp_files_and_indexes_good_files_with_tokens_and_sizes(tmp_path: Path) -> None:
    a = write_entry(tmp_path, "a.safetensors", [1, 2, 3])
    b = write_entry(tmp_path, "b.safetensors", [70_000, 5, 6, 7], seed=1)
    set_mtime(tmp_path / "a.safetensors", 1_000_000)
    (tmp_path / "tmp-a.safetensors.0123abcd.partial").write_bytes(b"half a file")
    (tmp_path / "tmp-x.safetensors.ffff.partial").write_bytes(b"")
    (tmp_path / "fingerprint.json").write_text("{}\n")
    (tmp_path / "subdir").mkdir()

    tier = SsdTier(tmp_path, BIG_CAP)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors", "fingerprint.json", "subdir"]
    entries = {e.name: e for e in tier.entries()}
    assert sorted(entries) == ["a.safetensors", "b.safetensors"]
    assert entries["a.safetensors"].tokens.tolist() == [1, 2, 3]
    assert entries["a.safetensors"].tokens.dtype == np.int64
    assert entries["b.safetensors"].tokens.tolist() == [70_000, 5, 6, 7]
    assert (entries["a.safetensors"].size, entries["b.safetensors"].size) == (a, b)
    assert entries["a.safetensors"].used == 1_000_000  # last use: the file's mtime
    assert len(tier) == 2 and tier.bytes == a + b
    assert "a.safetensors" in tier and "nothing.safetensors" not in tier
    assert tier.stats.quarantined == 0 and tier.stats.evicted == 0


def test_the_tier_makes_its_dir_private(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path / "kv" / "fp", BIG_CAP)
    assert tier.dir.is_dir()
    assert (tier.dir.stat().st_mode & 0o777) == 0o700
    assert len(tier) == 0


def test_the_scan_quarantines_files_that_are_not_ours(tmp_path: Path) -> None:
    from mlx_lm.models.cache import save_prompt_cache

    write_entry(tmp_path, "good.safetensors", [1, 2])
    (tmp_path / "garbage.safetensors").write_bytes(b"\x07" * 100)
    write_entry(tmp_path, "torn.safetensors", [3, 4])
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(torn.read_bytes()[:-10])
    save_prompt_cache(str(tmp_path / "foreign.safetensors"), make_kv())

    tier = SsdTier(tmp_path, BIG_CAP)

    assert [e.name for e in tier.entries()] == ["good.safetensors"]
    assert quarantined(tmp_path) == ["foreign.safetensors", "garbage.safetensors", "torn.safetensors"]
    assert tier.stats.quarantined == 3
    assert not (tmp_path / "garbage.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.safetensors", QUARANTINE]


def test_quarantine_keeps_only_the_newest_files(tmp_path: Path) -> None:
    count = QUARANTINE_KEEP + 5
    for i in range(count):
        path = tmp_path / f"bad-{i:02d}.safetensors"
        path.write_bytes(b"not a cache file")
        set_mtime(path, 1_000_000 + i)  # later files are newer

    tier = SsdTier(tmp_path, BIG_CAP)

    assert tier.stats.quarantined == count
    assert quarantined(tmp_path) == [f"bad-{i:02d}.safetensors" for i in range(count - QUARANTINE_KEEP, count)]
    assert len(tier) == 0


def test_a_file_whose_token_field_is_not_base64_is_quarantined_at_start(tmp_path: Path) -> None:
    write_entry(tmp_path, "good.safetensors", [4, 5])
    path = tmp_path / "flipped.safetensors"
    write_entry(tmp_path, path.name, [1, 2, 3])
    raw = path.read_bytes()
    at = raw.index(kv_files.encode_tokens([1, 2, 3]).encode())
    flip_bit(path, at, 0)  # 'A' -> '@'

    tier = SsdTier(tmp_path, BIG_CAP)

    assert [e.name for e in tier.entries()] == ["good.safetensors"]
    assert quarantined(tmp_path) == ["flipped.safetensors"]


def flip_to_a_token_past_int32(path: Path, tokens: list[int]) -> list[int]:
    """Flip the one bit in `path`'s token field that turns a token into one >= 2**31 while the
    field stays valid base64 in valid JSON; the tokens the header then says."""
    field = kv_files.encode_tokens(tokens)
    raw = path.read_bytes()
    at = raw.index(field.encode())
    alphabet = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
    for i, ch in enumerate(field):
        for bit in range(7):
            new = chr(ord(ch) ^ (1 << bit))
            if new not in alphabet:
                continue
            decoded = kv_files.decode_tokens(field[:i] + new + field[i + 1:])
            if max(decoded) >= 2**31:
                flip_bit(path, at + i, bit)
                return decoded
    raise AssertionError("no such flip")


def test_a_file_with_a_token_past_int32_does_not_stop_the_tier_from_starting(tmp_path: Path) -> None:
    path = tmp_path / "flipped.safetensors"
    tokens = [2**31 - 1, 7, 8]
    write_entry(tmp_path, path.name, tokens)
    now_says = flip_to_a_token_past_int32(path, tokens)
    assert max(now_says) >= 2**31
    with pytest.raises(kv_files.CorruptFile):
        kv_files.verify(path)  # a restore would have caught it; the scan reads the header only

    tier = SsdTier(tmp_path, BIG_CAP)  # starts: the scan takes the header's word for the tokens

    assert "flipped.safetensors" in tier
    assert tier.restore(entry_of(tier, "flipped.safetensors")) is None  # the checksum catches it there
    assert "flipped.safetensors" not in tier and tier.stats.quarantined == 1


# --- restore ----------------------------------------------------------------------------------


def entry_of(tier: SsdTier, name: str) -> DiskEntry:
    (entry,) = [e for e in tier.entries() if e.name == name]
    return entry


def test_restore_gives_back_the_cache_that_was_written(tmp_path: Path) -> None:
    kv = make_kv(n=6, layers=3, seed=4)
    meta, tensors, _owner = tensors_of(kv)
    size = kv_files.write_file(tmp_path, "e.safetensors", list(range(6)), meta, tensors)
    set_mtime(tmp_path / "e.safetensors", 1_000_000)
    tier = SsdTier(tmp_path, BIG_CAP)
    entry = entry_of(tier, "e.safetensors")

    cache = tier.restore(entry)

    assert cache is not None and len(cache) == 3
    assert [type(c) for c in cache] == [KVCache] * 3
    for got, want in zip(cache, kv, strict=True):
        assert got.offset == 6
        assert got.keys.dtype == mx.bfloat16
        assert mx.array_equal(got.keys, want.keys).item() and mx.array_equal(got.values, want.values).item()
    assert (tier.stats.restores, tier.stats.restored_bytes) == (1, size)
    assert entry.used > 1_000_000  # a restore is a use...
    assert (tmp_path / "e.safetensors").stat().st_mtime > 1_000_000  # ...that the next scan sees
    assert tier.stats.quarantined == 0


@pytest.mark.parametrize("where", ["header", "data"])
def test_restore_of_a_flipped_file_quarantines_it_and_misses(tmp_path: Path, where: str) -> None:
    write_entry(tmp_path, "e.safetensors", [1, 2, 3])
    tier = SsdTier(tmp_path, BIG_CAP)
    entry = entry_of(tier, "e.safetensors")
    path = tmp_path / "e.safetensors"
    header = kv_files.read_header(path)
    if where == "header":
        at = path.read_bytes().index(header.metadata["0.mlxd_checksum"].encode())
        flip_bit(path, at, 0)
    else:
        flip_bit(path, header.data_start + 100, 3)

    assert tier.restore(entry) is None

    assert "e.safetensors" not in tier and len(tier) == 0
    assert not path.exists()
    assert quarantined(tmp_path) == ["e.safetensors"]
    assert tier.stats.quarantined == 1 and tier.stats.restores == 0


def test_restore_of_a_file_that_passes_its_checksum_but_mlx_lm_cannot_load_quarantines_it(tmp_path: Path) -> None:
    meta, tensors, _owner = tensors_of(make_kv())
    kv_files.write_file(tmp_path, "e.safetensors", [1, 2, 3, 4, 5], {**meta, "1.0": "NoSuchCache"}, tensors)
    tier = SsdTier(tmp_path, BIG_CAP)
    kv_files.verify(tmp_path / "e.safetensors")

    assert tier.restore(entry_of(tier, "e.safetensors")) is None

    assert "e.safetensors" not in tier
    assert quarantined(tmp_path) == ["e.safetensors"]


def test_restore_of_a_file_deleted_behind_the_tiers_back_misses_without_raising(tmp_path: Path) -> None:
    write_entry(tmp_path, "e.safetensors", [1, 2, 3])
    write_entry(tmp_path, "other.safetensors", [7, 8], seed=1)
    tier = SsdTier(tmp_path, BIG_CAP)
    entry = entry_of(tier, "e.safetensors")
    (tmp_path / "e.safetensors").unlink()

    assert tier.restore(entry) is None

    assert [e.name for e in tier.entries()] == ["other.safetensors"]
    assert tier.stats.restores == 0


def test_a_file_deleted_behind_the_tiers_back_is_not_counted_as_quarantined(tmp_path: Path) -> None:
    write_entry(tmp_path, "e.safetensors", [1, 2, 3])
    tier = SsdTier(tmp_path, BIG_CAP)
    entry = entry_of(tier, "e.safetensors")
    (tmp_path / "e.safetensors").unlink()

    assert tier.restore(entry) is None

    assert tier.stats.quarantined == 0


# --- the index: prefixes and eviction --------------------------------------------------------


def test_the_scan_evicts_the_least_recently_used_files_over_the_cap(tmp_path: Path) -> None:
    sizes = {}
    for i, name in enumerate(["old.safetensors", "mid.safetensors", "new.safetensors"]):
        sizes[name] = write_entry(tmp_path, name, [i, 100 + i], seed=i)
        set_mtime(tmp_path / name, 1_000_000 + 1000 * i)
    assert len(set(sizes.values())) == 1

    tier = SsdTier(tmp_path, cap_bytes=2 * sizes["old.safetensors"])

    assert sorted(e.name for e in tier.entries()) == ["mid.safetensors", "new.safetensors"]
    assert not (tmp_path / "old.safetensors").exists()
    assert tier.stats.evicted == 1
    assert tier.bytes <= tier.cap_bytes


def test_eviction_over_the_cap_deletes_least_recently_used_first_and_touch_counts(tmp_path: Path) -> None:
    names = ["a.safetensors", "b.safetensors", "c.safetensors"]
    size = 0
    for i, name in enumerate(names):
        size = write_entry(tmp_path, name, [i, 10 + i], seed=i)
        set_mtime(tmp_path / name, 1_000_000 + 1000 * i)  # a oldest, c newest
    tier = SsdTier(tmp_path, cap_bytes=3 * size)
    assert len(tier) == 3

    tier.touch("a.safetensors")  # a is now the most recently used
    tier.touch("gone.safetensors")  # a name the tier does not hold: nothing happens
    assert entry_of(tier, "a.safetensors").used > 1_002_000
    assert write_entry(tmp_path, "d.safetensors", [3, 13], seed=3) == size
    tier.add("d.safetensors", np.asarray([3, 13], dtype=np.int32), size)

    assert sorted(e.name for e in tier.entries()) == ["a.safetensors", "c.safetensors", "d.safetensors"]
    assert not (tmp_path / "b.safetensors").exists()
    assert tier.stats.evicted == 1

    tier.cap_bytes = size
    tier.add("d.safetensors", np.asarray([3, 13], dtype=np.int32), size)  # re-adding is a use
    assert [e.name for e in tier.entries()] == ["d.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.safetensors"]
    assert tier.stats.evicted == 3


def test_pinned_entries_outlive_eviction_over_the_cap(tmp_path: Path) -> None:
    """An engine group's ranks pin the entries rank 0 may use next: the writer evicts around them."""
    names = ["a.safetensors", "b.safetensors"]
    size = 0
    for i, name in enumerate(names):
        size = write_entry(tmp_path, name, [i, 10 + i], seed=i)
        set_mtime(tmp_path / name, 1_000_000 + 1000 * i)  # a oldest
    tier = SsdTier(tmp_path, cap_bytes=2 * size)
    tier.pinned = frozenset({"a.safetensors"})
    assert write_entry(tmp_path, "c.safetensors", [2, 12], seed=2) == size
    tier.add("c.safetensors", np.asarray([2, 12], dtype=np.int32), size)

    assert sorted(e.name for e in tier.entries()) == ["a.safetensors", "c.safetensors"]  # b went, not a


def test_add_drops_files_whose_tokens_are_a_strict_prefix_of_it(tmp_path: Path) -> None:
    entries = {
        "p1.safetensors": [1, 2],
        "p2.safetensors": [1, 2, 3],
        "other.safetensors": [1, 2, 9],
        "longer.safetensors": [1, 2, 3, 4, 5, 6],
        "unrelated.safetensors": [7],
    }
    for i, (name, tokens) in enumerate(entries.items()):
        write_entry(tmp_path, name, tokens, seed=i)
    tier = SsdTier(tmp_path, BIG_CAP)
    size = write_entry(tmp_path, "new.safetensors", [1, 2, 3, 4], seed=9)

    tier.add("new.safetensors", np.asarray([1, 2, 3, 4], dtype=np.int32), size)

    kept = ["longer.safetensors", "new.safetensors", "other.safetensors", "unrelated.safetensors"]
    assert sorted(e.name for e in tier.entries()) == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == kept  # the files are gone too
    assert tier.stats.evicted == 0  # made redundant, not evicted


def test_is_prefix() -> None:
    a = np.asarray([1, 2, 3], dtype=np.int32)
    assert ssd_tier.is_prefix(a[:0], a)
    assert ssd_tier.is_prefix(a[:2], a)
    assert ssd_tier.is_prefix(a, a)
    assert not ssd_tier.is_prefix(a, a[:2])
    assert not ssd_tier.is_prefix(np.asarray([1, 3], dtype=np.int32), a)


def test_the_default_cap_is_a_quarter_of_the_usable_space_at_most_32_gib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = write_entry(tmp_path, "e.safetensors", [1, 2])
    (tmp_path / "fingerprint.json").write_text("x" * 10_000)  # not an entry: not counted
    usage = type("Usage", (), {})
    usage.free = 4_000_000  # type: ignore[attr-defined]
    monkeypatch.setattr(ssd_tier.shutil, "disk_usage", lambda path: usage)
    assert ssd_tier.default_ssd_cache_bytes(tmp_path) == (4_000_000 + held) // 4
    usage.free = 10**15  # type: ignore[attr-defined]
    assert ssd_tier.default_ssd_cache_bytes(tmp_path) == ssd_tier.DEFAULT_MAX


# --- the writer ----------------------------------------------------------------------------------


def test_the_writer_writes_a_job_and_the_tier_then_holds_it(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, BIG_CAP)
    idle = threading.Event()
    idle.set()
    done = Done()
    with running_writer(tier, idle) as writer:
        writer.submit(make_job("e.safetensors", [5, 6, 7], urgent=False, done=done))
        assert done.wait() == [True]
        assert wait_for(lambda: writer.pending == 0, TIMEOUT_S, interval=0.002)

    assert "e.safetensors" in tier
    entry = entry_of(tier, "e.safetensors")
    assert entry.tokens.tolist() == [5, 6, 7]
    assert entry.size == (tmp_path / "e.safetensors").stat().st_size
    assert kv_files.verify(tmp_path / "e.safetensors").tokens == [5, 6, 7]
    assert (tier.stats.writes, tier.stats.written_bytes, tier.stats.write_errors) == (1, entry.size, 0)
    assert temp_files(tmp_path) == []
    snap = tier.snapshot()
    assert (snap.entries, snap.bytes, snap.writes) == (1, entry.size, 1)
    restored = tier.restore(entry)
    assert restored is not None and restored[0].offset == 3


def test_the_writer_skips_an_entry_the_tier_already_holds(tmp_path: Path) -> None:
    write_entry(tmp_path, "e.safetensors", [5, 6, 7])
    before = (tmp_path / "e.safetensors").read_bytes()
    tier = SsdTier(tmp_path, BIG_CAP)
    idle = threading.Event()
    idle.set()
    done = Done()
    with running_writer(tier, idle) as writer:
        writer.submit(make_job("e.safetensors", [5, 6, 7], urgent=True, done=done, seed=3))
        assert done.wait() == [True]
    assert tier.stats.writes == 0
    assert (tmp_path / "e.safetensors").read_bytes() == before


def test_a_write_behind_job_waits_while_the_gpu_is_busy(tmp_path: Path, small_chunks: int) -> None:
    tier = SsdTier(tmp_path, BIG_CAP)
    idle = CountingIdle()  # busy
    done = Done()
    with running_writer(tier, idle) as writer:
        writer.submit(make_job("e.safetensors", [1, 2, 3, 4, 5], urgent=False, done=done))
        assert wait_for(lambda: idle.checks >= 5, TIMEOUT_S, interval=0.002)  # it has looked, and waited, several times

        assert done.results == [] and writer.pending == 1
        assert writer.pending_bytes > 0
        assert "e.safetensors" not in tier and not (tmp_path / "e.safetensors").exists()
        (temp,) = temp_files(tmp_path)
        (n,) = struct.unpack("<Q", temp.read_bytes()[:8])
        assert temp.stat().st_size == 8 + n  # the header, and no data yet

        idle.set()
        assert done.wait() == [True]
    assert "e.safetensors" in tier
    kv_files.verify(tmp_path / "e.safetensors")
    assert temp_files(tmp_path) == []


def test_a_write_behind_job_pauses_between_chunks_when_the_gpu_gets_busy(tmp_path: Path, small_chunks: int) -> None:
    tier = SsdTier(tmp_path, BIG_CAP)
    idle = BusyAfter(3)  # three chunks go out, then the GPU is busy
    done = Done()
    with running_writer(tier, idle) as writer:
        job = make_job("e.safetensors", [1, 2, 3, 4, 5], urgent=False, done=done)
        assert job.tensors[0].data.nbytes >= 4 * small_chunks
        writer.submit(job)
        assert wait_for(lambda: idle.checks >= 3 + 4, TIMEOUT_S, interval=0.002)  # and then several looks while busy

        assert done.results == []
        (temp,) = temp_files(tmp_path)
        (n,) = struct.unpack("<Q", temp.read_bytes()[:8])
        assert temp.stat().st_size == 8 + n + 3 * small_chunks

        idle.set()
        assert done.wait() == [True]
    kv_files.verify(tmp_path / "e.safetensors")


def test_an_urgent_job_does_not_wait_for_an_idle_gpu(tmp_path: Path, small_chunks: int) -> None:
    tier = SsdTier(tmp_path, BIG_CAP)
    idle = CountingIdle()  # busy, and never set during the job
    done = Done()
    writer = Writer(tier, idle)
    try:
        writer.submit(make_job("e.safetensors", [1, 2, 3], urgent=True, done=done))
        assert done.wait() == [True]
        assert not idle.is_set()
    finally:
        idle.set()
        writer.stop()
        writer._thread.join(TIMEOUT_S)
    assert "e.safetensors" in tier


def test_flush_writes_a_write_behind_job_while_the_gpu_is_busy(tmp_path: Path, small_chunks: int) -> None:
    tier = SsdTier(tmp_path, BIG_CAP)
    idle = CountingIdle()
    dones = [Done(), Done()]
    writer = Writer(tier, idle)
    try:
        jobs = [make_job("a.safetensors", [1, 2, 3], urgent=False, done=dones[0], seed=1),
                make_job("b.safetensors", [4, 5, 6], urgent=False, done=dones[1], seed=2)]
        for job in jobs:
            writer.submit(job)
        assert writer.pending == 2
        assert writer.pending_bytes == sum(j.nbytes for j in jobs) > 0
        assert writer.flush(TIMEOUT_S) is True
        assert not idle.is_set()  # no idle moment was needed
        assert writer.pending == 0 and writer.pending_bytes == 0
        assert [d.results for d in dones] == [[True], [True]]
        assert sorted(e.name for e in tier.entries()) == ["a.safetensors", "b.safetensors"]
    finally:
        idle.set()
        writer.stop()
        writer._thread.join(TIMEOUT_S)


def test_flush_with_nothing_pending_returns_at_once(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, BIG_CAP)
    with running_writer(tier, threading.Event()) as writer:
        assert writer.flush(0.0) is True


def test_flush_gives_up_at_its_timeout_while_a_write_cannot_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = SsdTier(tmp_path, BIG_CAP)
    release = threading.Event()
    real = kv_files.write_file

    def stuck(*args: Any, **kwargs: Any) -> int:
        assert release.wait(TIMEOUT_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(kv_files, "write_file", stuck)
    done = Done()
    with running_writer(tier, threading.Event()) as writer:
        writer.submit(make_job("e.safetensors", [1, 2], urgent=True, done=done))
        assert writer.flush(0.05) is False
        assert writer.pending == 1
        release.set()
        assert writer.flush(TIMEOUT_S) is True
    assert done.results == [True]


def test_a_disk_full_write_is_counted_and_the_writer_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = SsdTier(tmp_path, BIG_CAP)
    real = kv_files.write_file
    calls = 0

    def full_once(*args: Any, **kwargs: Any) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(kv_files, "write_file", full_once)
    first, second = Done(), Done()
    idle = threading.Event()
    idle.set()
    with running_writer(tier, idle) as writer:
        writer.submit(make_job("a.safetensors", [1, 2, 3], urgent=True, done=first, seed=1))
        assert first.wait() == [False]
        assert tier.stats.write_errors == 1 and tier.stats.writes == 0
        assert "a.safetensors" not in tier

        writer.submit(make_job("b.safetensors", [4, 5, 6], urgent=True, done=second, seed=2))
        assert second.wait() == [True]
    assert [e.name for e in tier.entries()] == ["b.safetensors"]
    assert (tier.stats.write_errors, tier.stats.writes) == (1, 1)
    assert tier.snapshot().write_errors == 1


def test_a_disk_full_mid_file_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = SsdTier(tmp_path, BIG_CAP)
    real = kv_files._write_all
    writes = 0

    def full(fd: int, data: bytes | memoryview) -> None:
        nonlocal writes
        writes += 1
        if writes == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(kv_files, "_write_all", full)
    done = Done()
    with running_writer(tier, threading.Event()) as writer:
        writer.submit(make_job("a.safetensors", [1, 2, 3], urgent=True, done=done))
        assert done.wait() == [False]
    assert tier.stats.write_errors == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="running as root: chmod 0o500 does not stop root from writing")
def test_an_unwritable_dir_is_counted_and_the_writer_goes_on(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path / "kv", BIG_CAP)
    first, second = Done(), Done()
    with running_writer(tier, threading.Event()) as writer:
        tier.dir.chmod(0o500)
        try:
            writer.submit(make_job("a.safetensors", [1, 2, 3], urgent=True, done=first, seed=1))
            assert first.wait() == [False]
        finally:
            tier.dir.chmod(0o700)
        assert tier.stats.write_errors == 1
        writer.submit(make_job("b.safetensors", [4, 5, 6], urgent=True, done=second, seed=2))
        assert second.wait() == [True]
    assert [e.name for e in tier.entries()] == ["b.safetensors"]


def test_a_done_callback_that_raises_does_not_stop_the_writer(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, BIG_CAP)

    def bad(ok: bool) -> None:
        raise RuntimeError("callback bug")

    done = Done()
    with running_writer(tier, threading.Event()) as writer:
        writer.submit(make_job("a.safetensors", [1, 2, 3], urgent=True, done=bad, seed=1))
        writer.submit(make_job("b.safetensors", [4, 5, 6], urgent=True, done=done, seed=2))
        assert done.wait() == [True]
        assert wait_for(lambda: writer.pending == 0, TIMEOUT_S, interval=0.002)
    assert sorted(e.name for e in tier.entries()) == ["a.safetensors", "b.safetensors"]


def test_a_written_job_drops_its_buffers(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, BIG_CAP)
    done = Done()
    job = make_job("a.safetensors", [1, 2, 3], urgent=True, done=done)
    with running_writer(tier, threading.Event()) as writer:
        writer.submit(job)
        assert done.wait() == [True]
        assert wait_for(lambda: writer.pending == 0, TIMEOUT_S, interval=0.002)
    assert job.tensors is None and job.owner is None
