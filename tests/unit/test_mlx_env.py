"""The MLX settings the engine starts with (mlxd/engine/mlx_env.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlxd.engine import mlx_env


def test_cuda_gets_its_settings_with_the_kernel_cache_under_the_xdg_cache_dir() -> None:
    env = {"HOME": "/home/u", "XDG_CACHE_HOME": "/data/cache"}
    assert mlx_env.defaults(env, cuda=True, version="0.32.4") == {
        "MLX_PTX_CACHE_DIR": "/data/cache/mlxd/mlx-kernels/0.32.4",
        "MLX_MAX_OPS_PER_BUFFER": "100",
        "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",  # a long-lived engine must not fail after N new shapes
        "MLX_CUDA_SDPA_CACHE_SIZE": "1024",
        "MLX_USE_CUDA_GRAPHS": "0",  # direct launches: less host time a decode step than graph upkeep
    }


def test_without_xdg_cache_home_the_kernel_cache_is_under_home() -> None:
    added = mlx_env.defaults({"HOME": "/home/u"}, cuda=True, version="0.31.0")
    assert added["MLX_PTX_CACHE_DIR"] == "/home/u/.cache/mlxd/mlx-kernels/0.31.0"


def test_metal_and_cpu_get_none() -> None:
    # MLX_MAX_OPS_PER_BUFFER is also read by Metal, where it was not measured: left alone.
    assert mlx_env.defaults({"HOME": "/home/u"}, cuda=False, version="0.32.4") == {}


def test_what_the_user_sets_wins() -> None:
    env = {"HOME": "/h", "MLX_MAX_OPS_PER_BUFFER": "20", "MLX_ENABLE_CACHE_THRASHING_CHECK": "1",
           "MLX_CUDA_SDPA_CACHE_SIZE": "64", "MLX_USE_CUDA_GRAPHS": "1"}
    assert mlx_env.defaults(env, cuda=True, version="1") == {"MLX_PTX_CACHE_DIR": "/h/.cache/mlxd/mlx-kernels/1"}


def test_settings_the_environment_gave_are_named_for_the_log() -> None:
    env = {"HOME": "/h", "MLX_USE_CUDA_GRAPHS": "1", "MLX_OTHER": "x"}  # [pool] cuda_graphs = true
    added = mlx_env.defaults(env, cuda=True, version="1")
    assert mlx_env.given({**env, **added}, added) == {"MLX_USE_CUDA_GRAPHS": "1"}
    assert mlx_env.given({"HOME": "/h"}, {}) == {}
    assert set(mlx_env.SETTINGS) == set(mlx_env.defaults({}, cuda=True, version="1"))  # every one it sets


def test_the_engine_process_sees_the_settings_before_mlx_loads(tmp_path: Path) -> None:
    # apply() runs in a fresh interpreter, as the engine's __main__ does, and leaves set values alone.
    code = (
        "import os, sys; from mlxd.engine import mlx_env; "
        "mlx_env.is_cuda_build = lambda: True; added = mlx_env.apply(); "
        "print(os.environ['MLX_ENABLE_CACHE_THRASHING_CHECK'], os.environ['MLX_MAX_OPS_PER_BUFFER'], sorted(added), "
        "'mlx' in sys.modules)"
    )
    env = {**os.environ, "MLX_MAX_OPS_PER_BUFFER": "7"}
    env.pop("MLX_ENABLE_CACHE_THRASHING_CHECK", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[:2] == ["0", "7"]
    assert "MLX_ENABLE_CACHE_THRASHING_CHECK" in out and "MLX_MAX_OPS_PER_BUFFER'" not in out
    assert out.split()[-1] == "False"  # set before mlx is imported


def test_a_kernel_cache_with_no_file_yet_is_cold_on_cuda_only(tmp_path: Path) -> None:
    cache = tmp_path / "mlx-kernels" / "0.32.4"
    env = {"MLX_PTX_CACHE_DIR": str(cache)}
    assert mlx_env.cold_kernel_cache(env, cuda=True) == cache  # not there yet
    (cache / "sub").mkdir(parents=True)
    assert mlx_env.cold_kernel_cache(env, cuda=True) == cache  # there, but empty
    (cache / "sub" / "kernel.ptx").write_text("ptx")
    assert mlx_env.cold_kernel_cache(env, cuda=True) is None  # filled by an earlier start
    assert mlx_env.cold_kernel_cache({"MLX_PTX_CACHE_DIR": str(tmp_path / "none")}, cuda=False) is None
    assert mlx_env.cold_kernel_cache({}, cuda=True) is None  # MLX's own default: nothing to say
