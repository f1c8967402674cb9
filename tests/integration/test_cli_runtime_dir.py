"""`mlxd serve` and `mlxd engine` refuse a runtime dir that is not private: one line, exit 1, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

OTHER_UID = 12345


def open_to_others(path: Path) -> str:
    path.mkdir(mode=0o700)
    path.chmod(0o755)
    return f"runtime dir {path} is not private (mode 755); it must be 0700 and owned by you: chmod 700 {path}"


def of_another_user(path: Path) -> str:
    path.mkdir(mode=0o700)
    os.chown(path, OTHER_UID, -1)
    return f"runtime dir {path} is owned by uid {OTHER_UID}, not by you (uid {os.getuid()}); it must be 0700"


def a_symlink(path: Path) -> str:
    target = path.with_name("real")
    target.mkdir(mode=0o700)
    path.symlink_to(target)
    return f"runtime dir {path} is a symlink (to {target}); mlxd refuses it"


def a_file(path: Path) -> str:
    path.write_text("")
    return f"runtime dir {path} is not a directory"


CASES: list[Callable[[Path], str]] = [open_to_others, of_another_user, a_symlink, a_file]
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")


@pytest.mark.parametrize("command", ["serve", "engine"])
@pytest.mark.parametrize(
    "make_bad", [pytest.param(c, marks=needs_root) if c is of_another_user else c for c in CASES]
)
def test_a_bad_runtime_dir_is_one_line_and_exit_1(tmp_path: Path, command: str, make_bad: Callable[[Path], str]) -> None:
    runtime = tmp_path / "run"
    expected = make_bad(runtime)
    (tmp_path / "empty.toml").write_text("")
    env = {**os.environ, "MLXD_RUNTIME_DIR": str(runtime), "MLXD_CONFIG": str(tmp_path / "empty.toml"),
           "MLXD_DATA_DIR": str(tmp_path / "data")}
    args = ["--port", "1"] if command == "serve" else [str(tmp_path)]  # never bound / loaded: refused first
    out = subprocess.run([sys.executable, "-m", "mlxd", command, *args], capture_output=True, text=True,
                         env=env, timeout=30, check=False)
    assert out.returncode == 1
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"Error: {expected}"), out.stderr
