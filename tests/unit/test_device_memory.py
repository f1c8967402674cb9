"""What MLX may keep of freed buffers (mlxd/engine/gpu/device_memory.py), on this machine's CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlxd.engine.gpu.device_memory import CPU_CACHE_BYTES, cache_limit_bytes, device_kind
from mlxd.engine.gpu.options import GatewayOptions
from mlxd.protocol.sizing import headroom_bytes


def test_on_the_cpu_the_cache_stays_small_whatever_the_memory() -> None:
    assert device_kind() == "cpu", "these tests run on MLX's CPU build"
    # The headroom of a 16 GiB budget would be gigabytes: on the CPU the cache stays at MLX's default.
    assert headroom_bytes(16 * 1024**3) > 10 * CPU_CACHE_BYTES
    assert cache_limit_bytes(GatewayOptions(memory_bytes=16 * 1024**3)) == CPU_CACHE_BYTES
    assert cache_limit_bytes(GatewayOptions()) == CPU_CACHE_BYTES


def test_the_cpu_limit_is_mlxs_own_cpu_default() -> None:
    # set_cache_limit returns the limit it replaces: in a fresh process, MLX's default.
    code = "import mlx.core as mx; print(mx.set_cache_limit(0))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert int(out.stdout) == CPU_CACHE_BYTES


def test_on_cuda_the_default_prompt_cache_is_at_most_a_tenth_of_the_gpus_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its entries live in the GPU's memory there: 10% of a 256 GB host's RAM (25.6 GB) beside a
    24 GB GPU would leave a 14B 8-bit model no room for KV."""
    from mlxd.engine.gpu import device_memory as dm

    gb = 10**9
    monkeypatch.setattr(dm, "device_memory_bytes", lambda device: 24 * gb if device == "cuda" else None)
    host_default = GatewayOptions(prompt_cache_bytes=25_600_000_000, prompt_cache_auto=True)
    assert dm.prompt_cache_sized(host_default, "cuda").prompt_cache_bytes == int(2.4 * gb)
    configured = GatewayOptions(prompt_cache_bytes=25_600_000_000)  # the user's own size stands
    assert dm.prompt_cache_sized(configured, "cuda").prompt_cache_bytes == 25_600_000_000
    small_host = GatewayOptions(prompt_cache_bytes=gb, prompt_cache_auto=True)  # the smaller of the two
    assert dm.prompt_cache_sized(small_host, "cuda").prompt_cache_bytes == gb
    bounded = GatewayOptions(prompt_cache_bytes=25_600_000_000, prompt_cache_auto=True, memory_bytes=8 * gb)
    assert dm.prompt_cache_sized(bounded, "cuda").prompt_cache_bytes == int(0.8 * gb)  # a share of what it may use
    for device in ("metal", "cpu"):  # one memory for both: the host's share stands
        assert dm.prompt_cache_sized(host_default, device) == host_default


def test_on_cuda_mlx_queues_work_within_the_memory_less_most_of_the_headroom(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long batched prefill holds what MLX lets it queue: on CUDA that stops at what the engine
    may use less 3/4 of the sizing's headroom, not at MLX's 95% of the card (an H100 ran out of
    memory), and above the KV budget's end, so a full budget's decode is not throttled."""
    from mlxd.engine.gpu import device_memory as dm

    gb = 10**9
    monkeypatch.setattr(dm, "device_memory_bytes", lambda device: 80 * gb if device == "cuda" else 64 * gb)
    limit = dm.memory_limit_bytes(GatewayOptions(), "cuda")
    assert limit == 80 * gb - 6 * gb  # 3/4 of the 8 GB headroom
    assert 80 * gb - headroom_bytes(80 * gb) < limit < 0.95 * 80 * gb  # above the budget's end, below MLX's own
    shared = GatewayOptions(memory_bytes=30 * gb)  # the supervisor's share for this engine bounds it
    assert dm.memory_limit_bytes(shared, "cuda") == 30 * gb - headroom_bytes(30 * gb) * 3 // 4
    for device in ("metal", "cpu"):  # MLX's own limit stays there
        assert dm.memory_limit_bytes(GatewayOptions(), device) is None
    assert dm.memory_limit_bytes(GatewayOptions(memory_bytes=256 * 1024**2), "cuda") is None  # below the headroom


def test_without_a_cuda_driver_there_is_no_card_to_report() -> None:
    """The driver's view of the card is read only where libcuda is (not on this CPU machine), and
    the memory line then says only what MLX says."""
    from mlxd.engine.gpu.cuda_memory import _driver, cuda_memory, cuda_memory_line, trim_pool
    from mlxd.engine.gpu.device_memory import memory_line

    if _driver() is not None or device_kind() == "cuda":
        pytest.skip("this machine has a CUDA driver: the path without one is not what runs here")
    assert cuda_memory() is None and trim_pool() is None
    assert cuda_memory_line(None) == ""
    assert "the card" not in memory_line() and memory_line().startswith("active ")
    gib = 1024**3
    line = cuda_memory_line({"device_used": 70 * gib, "device_total": 80 * gib, "pool_reserved": 60 * gib,
                             "pool_reserved_high": 75 * gib, "pool_used": 50 * gib, "pool_used_high": 74 * gib})
    assert line == ("; the card: 70.0 of 80.0 GiB used, CUDA pool reserved 60.0 GiB (high 75.0),"
                    " in use 50.0 GiB (high 74.0)")


def test_after_a_peak_mlxs_cache_of_freed_buffers_goes_back() -> None:
    """After the warm-up and after a failed step the engine hands back what MLX keeps of freed
    buffers (and on CUDA what the memory pool holds unused), and says how much."""
    import mlx.core as mx

    from mlxd.engine.gpu.device_memory import release_unused

    a = mx.ones((1024, 1024))
    mx.eval(a)
    del a
    cached = mx.get_cache_memory()
    assert cached >= 4 * 1024**2  # the freed 4 MiB stayed in MLX's cache
    line = release_unused()
    assert mx.get_cache_memory() == 0
    assert line.startswith(f"released {cached / 1024**3:.1f} GiB of MLX's cache")
    if device_kind() != "cuda":
        assert line == f"released {cached / 1024**3:.1f} GiB of MLX's cache"  # no CUDA pool to trim


def test_after_a_failed_step_its_arrays_go_back_too_and_the_release_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed step's traceback holds its arrays (and the generator that made them): they are
    let go of before MLX's cache is emptied. On a failure path the hand-back must not raise."""
    import mlx.core as mx

    from mlxd.engine.gpu import device_memory as dm

    def step() -> None:
        held = mx.ones((2048, 1024))  # 8 MiB only this frame holds
        mx.eval(held)
        raise RuntimeError("out of memory")

    try:
        step()
    except RuntimeError as exc:
        dm.release_unused()
        active = mx.get_active_memory()
        assert dm.release_unused(exc).startswith("released ")
        assert mx.get_active_memory() <= active - 8 * 1024**2  # the frame's array is gone
        assert mx.get_cache_memory() == 0

    def broken() -> None:
        raise RuntimeError("[CUDA] an illegal memory access was encountered")

    monkeypatch.setattr(dm.mx, "clear_cache", broken)
    assert dm.release_unused() == "could not release MLX's cache: [CUDA] an illegal memory access was encountered"
