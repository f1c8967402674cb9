"""What MLX may keep of freed buffers (mlxd/engine/gpu/device_memory.py), on this machine's CPU."""

from __future__ import annotations

import subprocess
import sys

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
