"""`mlxd start|status|stop` as real processes: a detached supervisor, its pid file, its log."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from mlxd.cli.service import spec as svc
from tests.support import free_port


class Cli:
    """Runs `mlxd ...` in a subprocess with a private data dir, runtime dir and config."""

    def __init__(self, root: Path) -> None:
        self.data = root / "data"
        self.config = root / "empty.toml"
        self.config.write_text("")
        self.runtime = Path(tempfile.mkdtemp(prefix="mx-", dir="/tmp"))
        self.runtime.chmod(0o700)
        home = root / "home"
        home.mkdir()
        # A private HOME and XDG_CONFIG_HOME: no installed service is found, so start spawns.
        self.env = {**os.environ, "MLXD_RUNTIME_DIR": str(self.runtime), "MLXD_CONFIG": str(self.config),
                    "HOME": str(home), "XDG_CONFIG_HOME": str(root / "xdg")}
        self.port = free_port()

    def __call__(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "mlxd", *args]
        return subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout, check=False)

    def start(self, port: int | None = None) -> subprocess.CompletedProcess[str]:
        return self("start", "--port", str(port or self.port), "--config", str(self.config), "--data-dir", str(self.data))

    def record(self) -> svc.PidRecord | None:
        return svc.read_pid_file(svc.pid_file(self.data))

    def kill_leftover(self) -> None:
        if (record := self.record()) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.runtime.rmdir()


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    runner = Cli(tmp_path)
    yield runner
    runner.kill_leftover()


def is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_start_status_stop_round_trip(cli: Cli) -> None:
    url = f"http://127.0.0.1:{cli.port}"
    started = cli.start()
    assert started.returncode == 0, started.stderr + started.stdout
    assert f"mlxd is running at {url}" in started.stdout
    record = cli.record()
    assert record is not None and record.port == cli.port
    proc = psutil.Process(record.pid)
    assert proc.cmdline()[1:4] == ["-m", "mlxd", "serve"]
    assert os.getsid(record.pid) == record.pid  # its own session: a closed terminal does not kill it
    assert (cli.data / "logs" / "mlxd.log").read_text().count("mlxd serving on") == 1
    # Made by `mlxd start`: readable by their owner only (the log holds prompts' errors, paths).
    assert modes(cli.data, "", "logs", "logs/mlxd.log", "mlxd.pid") == [0o700, 0o700, 0o600, 0o600]
    assert started.stderr == ""

    status = cli("status", "--data-dir", str(cli.data))
    assert status.returncode == 0, status.stderr
    assert f"mlxd is up at {url}" in status.stdout and f"pid {record.pid}" in status.stdout

    again = cli.start()
    assert again.returncode == 0, again.stderr
    assert "already running" in again.stdout and url in again.stdout
    assert cli.record() == record

    stopped = cli("stop", "--data-dir", str(cli.data))
    assert stopped.returncode == 0, stopped.stderr
    assert f"mlxd stopped (pid {record.pid})" in stopped.stdout
    assert is_gone(record.pid)
    assert not svc.pid_file(cli.data).exists()

    down = cli("status", "--json", "--data-dir", str(cli.data))
    assert down.returncode == 3, down.stdout + down.stderr
    assert '"status": "down"' in down.stdout
    not_running = cli("stop", "--data-dir", str(cli.data))
    assert not_running.returncode == 0 and "not running" in not_running.stdout


def modes(root: Path, *names: str) -> list[int]:
    return [stat.S_IMODE((root / name).stat().st_mode) for name in names]


def test_start_tightens_an_older_layout_and_warns_about_a_readable_config_with_keys(cli: Cli) -> None:
    (cli.data / "logs").mkdir(parents=True)
    cli.data.chmod(0o755)  # left as it is: it may be the user's own dir
    (cli.data / "logs").chmod(0o755)
    (cli.data / "logs" / "mlxd.log").write_text("an older run\n")
    (cli.data / "logs" / "mlxd.log").chmod(0o644)
    cli.config.write_text('[server]\napi_keys = ["sk-test"]\n')
    cli.config.chmod(0o644)
    warning = f"{cli.config} holds API keys and is readable by others (mode 644); run chmod 600 {cli.config}"
    started = cli.start()
    assert started.returncode == 0, started.stderr
    assert started.stderr.splitlines() == [
        f"warning: {warning}",
        f"note: {cli.data}/logs was open to others (mode 755); made it 700",
        f"note: {cli.data}/logs/mlxd.log was open to others (mode 644); made it 600",
    ]
    assert modes(cli.data, "", "logs", "logs/mlxd.log", "mlxd.pid") == [0o755, 0o700, 0o600, 0o600]
    log = (cli.data / "logs" / "mlxd.log").read_text()
    assert log.startswith("an older run\n") and log.count(f"WARNING mlxd.config: {warning}") == 1
    assert cli("stop", "--data-dir", str(cli.data)).returncode == 0
    cli.config.chmod(0o600)
    again = cli.start()
    assert again.returncode == 0 and again.stderr == "", again.stderr  # said once; a private config is quiet
    assert cli("stop", "--data-dir", str(cli.data)).returncode == 0


def test_a_stale_pid_file_is_replaced(cli: Cli) -> None:
    svc.write_pid_file(svc.pid_file(cli.data), svc.new_record(os.getpid(), "127.0.0.1", cli.port))
    started = cli.start()
    assert started.returncode == 0, started.stderr
    record = cli.record()
    assert record is not None and record.pid != os.getpid()
    assert cli("stop", "--data-dir", str(cli.data)).returncode == 0


def test_a_daemon_that_cannot_listen_fails_with_its_log(cli: Cli) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        failed = cli.start(port=taken.getsockname()[1])
    assert failed.returncode == 1
    assert "exited with code 1" in failed.stderr and "cannot listen" in failed.stderr
    assert not svc.pid_file(cli.data).exists()
