"""Checkpoint copies through page-locked host memory (engine/cache/pinned.py).

The kernel and the driver's memory need CUDA (benchmarks/pinned_copy.py checks them there). Here
the arena is plain host memory and a stand-in for the kernel writes each block's bytes and then
its flags from a thread of its own, late, as the GPU would: what is tested is everything around
it (the arena's slices, the flags, the writer waiting for them, the fallback when the arena is
full or the copy never comes)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlxd.engine.cache import kv_layout, pinned
from mlxd.engine.cache.pinned import ALIGN, FLAGS_BYTES, KERNEL_BLOCKS, Arena, Copier, HostCopy
from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.cache.ssd_tier import SsdTier
from tests.support import wait_for

BIG = 1 << 30


def host_arena(nbytes: int) -> Arena:
    return Arena(memoryview(bytearray(nbytes)), device_ptr=1 << 40)  # the GPU's address of it: anything


class LateCopier(Copier):
    """The kernel's stand-in: the block's bytes taken on the calling thread (the GPU thread), and
    written to the arena, then the flags set one by one, `delay_s` later from a thread (None: never)."""

    def __init__(self, arena: Arena, delay_s: float | None = 0.2) -> None:
        super().__init__()
        self.arena = arena
        self.delay_s = delay_s
        self.launched = 0

    def _launch(self, flat: mx.array, c: HostCopy | None, args: list[int]) -> mx.array:
        assert c is not None and args[6] == c.seq
        data = np.array(flat).tobytes()
        assert args[2] == len(data) and args[3] == 0 and (args[4] | args[5] << 32) == (args[0] | args[1] << 32) + len(data) + (-len(data) % 16)
        at = (args[0] | args[1] << 32) - self.arena.device_ptr  # type: ignore[union-attr]
        self.launched += 1

        def land() -> None:
            if self.delay_s is None:
                return
            time.sleep(self.delay_s)
            memory = self.arena.memory  # type: ignore[union-attr]
            memory[at:at + len(data)] = data
            flags = memory[at + len(data) + (-len(data) % 16):][:FLAGS_BYTES].cast("I")
            for k in range(KERNEL_BLOCKS):
                flags[k] = c.seq

        threading.Thread(target=land, daemon=True).start()
        return mx.array([c.seq], dtype=mx.uint32)


def test_the_arena_hands_out_aligned_slices_first_fit_and_joins_what_comes_back() -> None:
    arena = host_arena(16 * ALIGN)
    a, b, c = arena.take(1), arena.take(ALIGN + 1), arena.take(ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN)  # each rounded up to ALIGN
    assert arena.take(13 * ALIGN) is None and arena.free_bytes == 12 * ALIGN
    assert b is not None and a is not None and c is not None
    arena.give(b, ALIGN + 1)
    assert arena.take(2 * ALIGN) == ALIGN  # the hole it left, first
    arena.give(ALIGN, 2 * ALIGN)
    arena.give(a, 1)
    arena.give(c, ALIGN)
    assert arena.free_bytes == 16 * ALIGN and arena.take(16 * ALIGN) == 0  # joined again: one slice


def test_a_copy_is_ready_only_once_every_kernel_block_set_its_flag_and_stale_bytes_never_count() -> None:
    arena = host_arena(4096)
    arena.memory[:] = np.full(1024, 7, dtype=np.uint32).tobytes()  # an earlier copy's bytes, all reading as seq 7
    at = arena.take(100 + 12 + FLAGS_BYTES)
    assert at == 0
    c = HostCopy(arena, at, 100, seq=7)
    assert not c.ready  # its flags were cleared when it was made
    flags = arena.memory[112:112 + FLAGS_BYTES].cast("I")
    for k in range(KERNEL_BLOCKS - 1):
        flags[k] = 7
    assert not c.ready  # one thread block still copying
    flags[KERNEL_BLOCKS - 1] = 7
    assert c.ready and pinned.wait([c], 0.01)
    c.release()
    assert arena.free_bytes == 4096


def test_wait_gives_up_when_a_copy_never_comes() -> None:
    arena = host_arena(4096)
    c = HostCopy(arena, 0, 64, seq=1)
    started = time.monotonic()
    assert not pinned.wait([c], 0.2)
    assert 0.2 <= time.monotonic() - started < 2


def test_a_copier_takes_room_for_every_block_or_queues_none() -> None:
    arena = host_arena(4 * ALIGN)
    copier = LateCopier(arena)
    small, large = mx.zeros((64,), dtype=mx.uint8), mx.zeros((3 * ALIGN,), dtype=mx.uint8)
    assert copier.copy([small, large]) is None  # the second does not fit beside the first
    assert arena.free_bytes == 4 * ALIGN and copier.launched == 0
    assert copier.copy([]) is None
    got = copier.copy([small])
    assert got is not None and copier.launched == 1 and pinned.wait(got, 5)
    pinned.release(got)
    assert arena.free_bytes == 4 * ALIGN
    assert Copier().copy([small]) is None  # not allocated (yet): the other way


def bf16_rows(tokens: int, seed: int = 0) -> list[Any]:
    kv = []
    for i in range(2):
        c = KVCache()
        k1, k2 = mx.random.split(mx.random.key(seed * 10 + i))
        c.update_and_fetch(mx.random.normal((1, 2, tokens, 64), key=k1).astype(mx.bfloat16),
                           mx.random.normal((1, 2, tokens, 64), key=k2).astype(mx.bfloat16))
        kv.append(c)
    return kv


def tokens_of(n: int, start: int = 0) -> list[int]:
    return [(start + i) % 300 + 3 for i in range(n)]


@pytest.fixture
def grouped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_layout, "GROUP", True)  # as on CUDA
    monkeypatch.setattr(kv_layout, "BLOCK_BYTES", 8192)  # a few blocks a file


@pytest.mark.usefixtures("grouped")
def test_a_checkpoint_through_page_locked_memory_waits_for_its_copies_and_restores_bit_for_bit(
        tmp_path: Path) -> None:
    kv = bf16_rows(24)
    want = [(mx.array(c.keys[..., :24, :]), mx.array(c.values[..., :24, :])) for c in kv]
    arena = host_arena(1 << 20)
    pc = PrefixCache(BIG, SsdTier(tmp_path / "kv", BIG), threading.Event())
    pc.copier = LateCopier(arena, delay_s=0.3)
    taken = pc.checkpoint(kv, tokens_of(24))
    assert taken is not None and taken.staged is not None and taken.staged.host is not None
    assert taken.staged.blocks == [] and len(taken.staged.host) > 1  # the blocks dropped: the copies hold the bytes
    for c in kv:  # the row goes on writing into its cache
        c.update_and_fetch(mx.ones((1, 2, 4, 64), dtype=mx.bfloat16), mx.ones((1, 2, 4, 64), dtype=mx.bfloat16))
    pc.send_checkpoints()  # READ_A_TURN or not, nothing is read here: the writer waits for the flags
    assert taken.staged is None and not taken.on_ssd  # (had it not waited, the file would hold zeros)
    assert wait_for(lambda: pc.writes_pending == 0, 10) and taken.on_ssd
    assert arena.free_bytes == arena.nbytes  # every slice back once written
    got, cached = PrefixCache(BIG, SsdTier(tmp_path / "kv", BIG), threading.Event()).fetch([*tokens_of(24), 5])
    assert cached == 24 and got is not None
    for c, (keys, values) in zip(got, want, strict=True):
        assert c.keys.dtype == mx.bfloat16
        assert mx.array_equal(c.keys, keys).item() and mx.array_equal(c.values, values).item()
    pc.close()


@pytest.mark.usefixtures("grouped")
def test_a_checkpoint_the_arena_has_no_room_for_goes_the_other_way(tmp_path: Path) -> None:
    arena = host_arena(4 * ALIGN)  # far less than one checkpoint
    pc = PrefixCache(BIG, SsdTier(tmp_path / "kv", BIG), threading.Event())
    copier = pc.copier = LateCopier(arena)
    taken = pc.checkpoint(bf16_rows(24), tokens_of(24))
    assert taken is not None and taken.staged is not None and taken.staged.host is None and taken.staged.blocks
    assert copier.launched == 0
    pc.flush(10)
    assert taken.on_ssd and pc.ssd is not None and len(pc.ssd) == 1
    pc.close()


@pytest.mark.usefixtures("grouped")
def test_a_checkpoint_whose_copies_never_come_is_not_written_and_its_memory_is_not_reused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pinned, "WAIT_S", 0.3)
    arena = host_arena(1 << 20)
    pc = PrefixCache(BIG, SsdTier(tmp_path / "kv", BIG), threading.Event())
    pc.copier = LateCopier(arena, delay_s=None)  # the GPU died under it
    taken = pc.checkpoint(bf16_rows(24), tokens_of(24))
    assert taken is not None
    pc.send_checkpoints()
    assert wait_for(lambda: pc.writes_pending == 0, 10)
    assert taken.write_failed and not taken.on_ssd and pc.ssd is not None and len(pc.ssd) == 0
    assert arena.free_bytes < arena.nbytes  # a kernel may yet write there
    pc.close()


def test_without_a_cuda_driver_the_copier_says_why_and_copies_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    if mx.cuda.is_available():
        pytest.skip("this machine has a CUDA driver: benchmarks/pinned_copy.py checks the real thing")
    copier = Copier.start(1 << 20)
    assert wait_for(lambda: copier.failed is not None, 10)
    assert copier.arena is None and copier.copy([mx.zeros((8,))]) is None


def test_the_default_size_is_bounded_by_the_cache_and_the_host_and_the_setting_overrides_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLXD_CHECKPOINT_PINNED_MB", raising=False)
    assert pinned.default_bytes(1 << 30) == 1 << 29  # half the prompt cache's cap
    assert pinned.default_bytes(1 << 50) <= pinned.MOST_BYTES
    monkeypatch.setenv("MLXD_CHECKPOINT_PINNED_MB", "0")
    assert pinned.default_bytes(1 << 30) == 0
    monkeypatch.setenv("MLXD_CHECKPOINT_PINNED_MB", "300")
    assert pinned.default_bytes(1 << 30) == 300 << 20
    monkeypatch.setenv("MLXD_CHECKPOINT_PINNED_MB", "lots")  # said in the log; the engine starts all the same
    assert pinned.default_bytes(1 << 30) == 1 << 29


def test_a_kernel_that_fails_gives_its_slices_back_and_the_copier_up() -> None:
    class Broken(LateCopier):
        def _launch(self, flat: mx.array, c: HostCopy | None, args: list[int]) -> mx.array:
            raise RuntimeError("nvrtc: compilation failed")

    arena = host_arena(1 << 16)
    copier = Broken(arena)
    assert copier.copy([mx.zeros((100,), dtype=mx.uint8)]) is None
    assert copier.failed is not None and "compilation failed" in copier.failed and copier.arena is None
    assert arena.free_bytes == arena.nbytes
    assert copier.copy([mx.zeros((100,), dtype=mx.uint8)]) is None  # the other way from now on
