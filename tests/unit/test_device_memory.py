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
