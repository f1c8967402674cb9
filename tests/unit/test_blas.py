"""Choosing OpenBLAS for the engine's CPU matmuls."""

from __future__ import annotations

from mlxd.engine import blas

LIB = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


def test_linux_cpu_wheel_with_openblas_preloads_it() -> None:
    env = blas.preload_env({"PATH": "/bin"}, platform="linux", cpu_wheel=True, openblas=LIB)
    assert env is not None
    assert env["LD_PRELOAD"] == LIB
    assert env[blas.REEXEC_MARK] == "1"
    assert env["PATH"] == "/bin"


def test_existing_preload_is_kept() -> None:
    env = blas.preload_env({"LD_PRELOAD": "/x.so"}, platform="linux", cpu_wheel=True, openblas=LIB)
    assert env is not None and env["LD_PRELOAD"] == f"{LIB} /x.so"


def test_no_reexec_when_not_wanted_or_not_possible() -> None:
    assert blas.preload_env({}, platform="darwin", cpu_wheel=False, openblas=None) is None
    assert blas.preload_env({}, platform="linux", cpu_wheel=False, openblas=LIB) is None  # CUDA wheel
    assert blas.preload_env({}, platform="linux", cpu_wheel=True, openblas=None) is None
    assert blas.preload_env({blas.REEXEC_MARK: "1"}, platform="linux", cpu_wheel=True, openblas=LIB) is None
    assert blas.preload_env({"MLXD_BLAS": "off"}, platform="linux", cpu_wheel=True, openblas=LIB) is None
    assert blas.preload_env({"LD_PRELOAD": LIB}, platform="linux", cpu_wheel=True, openblas=LIB) is None


def test_describe_names_the_preloaded_library() -> None:
    assert LIB in blas.describe({"LD_PRELOAD": LIB})


def test_find_openblas_returns_first_existing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    present = tmp_path / "libblas.so.3"
    present.write_bytes(b"")
    assert blas.find_openblas((str(tmp_path / "missing.so"), str(present))) == str(present)
    assert blas.find_openblas((str(tmp_path / "missing.so"),)) is None
