"""mlxd/paths.py: the runtime dir must be private (refused with one clear line), dirs mlxd makes are 0700."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from mlxd.paths import PrivateDirError, check_private_dir, ensure_private_dir, make_private_dirs

OTHER_UID = 12345


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def refusal(path: Path) -> str:
    with pytest.raises(PrivateDirError) as info:
        ensure_private_dir(path)
    return str(info.value)


def test_a_missing_runtime_dir_is_made_0700(tmp_path: Path) -> None:
    path = ensure_private_dir(tmp_path / "run")
    assert mode(path) == 0o700
    assert ensure_private_dir(path) == path  # and taken as it is the next time


def test_a_runtime_dir_open_to_others_is_refused_with_the_chmod(tmp_path: Path) -> None:
    path = tmp_path / "run dir"
    path.mkdir(mode=0o700)
    path.chmod(0o755)
    assert refusal(path) == (
        f"runtime dir {path} is not private (mode 755); it must be 0700 and owned by you: chmod 700 '{path}'"
    )
    assert mode(path) == 0o755  # refused, not changed


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_a_runtime_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    os.chown(path, OTHER_UID, -1)
    message = refusal(path)
    assert message.startswith(f"runtime dir {path} is owned by uid {OTHER_UID}, not by you (uid 0)")
    assert "MLXD_RUNTIME_DIR" in message


def test_a_symlinked_runtime_dir_is_refused_even_to_a_private_dir(tmp_path: Path) -> None:
    target = ensure_private_dir(tmp_path / "real")
    link = tmp_path / "run"
    link.symlink_to(target)
    assert refusal(link).startswith(f"runtime dir {link} is a symlink (to {target}); mlxd refuses it")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    assert refusal(dangling).startswith(f"runtime dir {dangling} is a symlink")
    assert not (tmp_path / "nowhere").exists()


def test_a_file_as_runtime_dir_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run"
    path.write_text("")
    assert refusal(path) == f"runtime dir {path} is not a directory: remove it, or set MLXD_RUNTIME_DIR to a dir of your own"


def test_a_runtime_dir_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    assert refusal(tmp_path / "file" / "run").startswith(f"cannot create runtime dir {tmp_path / 'file' / 'run'}: ")


def test_the_refusal_is_a_permission_error_as_before(tmp_path: Path) -> None:
    path = tmp_path / "run"
    path.mkdir(mode=0o755)
    path.chmod(0o755)
    with pytest.raises(PermissionError, match="0700"):  # the engine's socket check catches these
        check_private_dir(path)


def test_make_private_dirs_makes_each_missing_dir_0700_and_leaves_existing_ones(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    made = make_private_dirs(tmp_path / "a" / "b" / "data")
    assert made == tmp_path / "a" / "b" / "data"
    assert [mode(p) for p in (tmp_path, tmp_path / "a", tmp_path / "a" / "b", made)] == [0o755, 0o700, 0o700, 0o700]
    made.chmod(0o751)
    make_private_dirs(made / "logs")
    assert (mode(made), mode(made / "logs")) == (0o751, 0o700)  # the user's own dir keeps its mode


def test_make_private_dirs_over_a_file_fails(tmp_path: Path) -> None:
    (tmp_path / "data").write_text("")
    with pytest.raises(OSError):
        make_private_dirs(tmp_path / "data" / "logs")
