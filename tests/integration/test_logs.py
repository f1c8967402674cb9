"""`mlxd serve --log-format json` and `mlxd logs [-f]` against real daemons and engines."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from mlxd.cli.service import spec as svc
from tests.support import (
    NO_EOS,
    default_sigint,
    free_port,
    private_socket_dir,
    serving,
    wait_for,
)

# Contract 3: the keys every access line carries (values may be null).
ACCESS_KEYS = {"method", "path", "status", "model", "prompt_tokens", "cached_tokens", "completion_tokens",
               "ttft_ms", "tokens_per_s", "duration_ms"}


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of a JSON log, each checked to be one JSON object."""
    lines = []
    for line in text.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not a JSON line: {line!r}")
        assert isinstance(lines[-1], dict) and {"ts", "level", "logger", "msg"} <= set(lines[-1]), line
    return lines


def access_lines(text: str) -> list[dict[str, Any]]:
    """The access lines of a JSON log, read as far as it is written."""
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return [line for line in lines if line["logger"] == "mlxd.access"]


def test_serve_json_logs_start_engine_and_access_lines(tiny_model: Path, tmp_path: Path) -> None:
    with serving(tiny_model, "tiny", tmp_path / "sup", "--log-format", "json") as sup:
        resp = sup.client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logit_bias": NO_EOS,
        })
        assert resp.status_code == 200, resp.text
        # Written after the answer's last byte: wait for it rather than race it.
        assert wait_for(lambda: any(a["path"] == "/v1/chat/completions" for a in access_lines(sup.log())), 10), sup.log()
    lines = json_lines(sup.log())  # every line, the engine's relayed ones too
    assert any(line["msg"].startswith("mlxd serving on http://") for line in lines)
    engine = [line for line in lines if line.get("model") == "tiny" and line["logger"].startswith("mlxd.engine")]
    assert engine, "the engine's own lines are relayed into the log"
    chat = next(a for a in access_lines(sup.log()) if a["path"] == "/v1/chat/completions")
    assert set(chat) >= ACCESS_KEYS
    assert chat["method"] == "POST" and chat["status"] == 200 and chat["model"] == "tiny"
    assert chat["completion_tokens"] == 3


class Daemon:
    """`mlxd start|logs|stop` in subprocesses, with a private HOME, data dir and runtime dir."""

    def __init__(self, root: Path, config: str) -> None:
        self.data = root / "data"
        self.config = root / "config.toml"
        self.config.write_text(config)
        self.runtime = private_socket_dir()
        (root / "home").mkdir()
        # A private HOME and XDG_CONFIG_HOME: no installed service is found, so `start` spawns.
        self.env = {**os.environ, "MLXD_RUNTIME_DIR": str(self.runtime), "MLXD_CONFIG": str(self.config),
                    "MLXD_DATA_DIR": str(self.data), "HOME": str(root / "home"),
                    "XDG_CONFIG_HOME": str(root / "xdg"), "MLXD_SPARE_ENGINE": "0"}
        self.env.pop("MLXD_LOG_FORMAT", None)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "mlxd", *args]

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*args), capture_output=True, text=True, env=self.env, timeout=90, check=False)

    def stop(self) -> None:
        self("stop")
        if (record := svc.read_pid_file(svc.pid_file(self.data))) is not None:  # `stop` failed: don't leak it
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGKILL)


@pytest.fixture
def daemon(tiny_model: Path, tmp_path: Path) -> Iterator[Daemon]:
    runner = Daemon(tmp_path, f'[models.tiny]\npath = "{tiny_model}"\n')
    yield runner
    runner.stop()


class Follower:
    """`mlxd logs -f` with a thread reading its lines as they come."""

    def __init__(self, daemon: Daemon, *args: str) -> None:
        self.proc = subprocess.Popen(daemon.argv("logs", "-f", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=daemon.env, preexec_fn=default_sigint)
        self.lines: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))

    def next_matching(self, predicate: Any, timeout: float) -> str | None:
        """The next printed line that `predicate` accepts, or None after `timeout` seconds."""
        with contextlib.suppress(queue.Empty):
            while True:
                if predicate(line := self.lines.get(timeout=timeout)):
                    return line
        return None

    def interrupt(self) -> tuple[int, str]:
        """Ctrl-C; its exit code and stderr."""
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        return self.proc.returncode, err


def test_start_json_then_logs_and_logs_follow(daemon: Daemon) -> None:
    started = daemon("start", "--port", str(daemon.port), "--log-format", "json")
    assert started.returncode == 0, started.stderr + started.stdout

    shown = daemon("logs", "-n", "50")  # found through the pid file, as `mlxd status` finds the daemon
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr == ""
    starts = [line for line in json_lines(shown.stdout) if line["msg"].startswith("mlxd serving on")]
    assert [line["msg"].split()[3] for line in starts] == [f"{daemon.url}/v1"]

    follower = Follower(daemon, "-n", "1")
    try:
        # Its one old line printed: it is at the log's end, so what comes now is new.
        assert follower.next_matching(lambda text: True, timeout=30) is not None
        # An engine starting is a line the daemon writes now, whatever else it logs.
        loading = threading.Thread(target=httpx.post, args=(f"{daemon.url}/admin/load",),
                                   kwargs={"json": {"model": "tiny"}, "timeout": 90}, daemon=True)
        loading.start()
        line = follower.next_matching(lambda text: "engine pid" in text, timeout=30)
        assert line is not None, "no new line from `mlxd logs -f`"
        assert json.loads(line)["model"] == "tiny"
        code, err = follower.interrupt()
        assert (code, err) == (0, "")
        loading.join(90)
    finally:
        if follower.proc.poll() is None:
            follower.proc.kill()
            follower.proc.wait()


def test_serve_refuses_a_bad_log_format_or_level_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "MLXD_DATA_DIR": str(tmp_path), "MLXD_CONFIG": str(tmp_path / "none.toml")}
    argv = [sys.executable, "-m", "mlxd", "serve", "--port", str(free_port())]

    def serve(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*argv, *args], capture_output=True, text=True, env={**env, **extra}, timeout=60, check=False)

    bad_flag = serve("--log-format", "xml")
    assert bad_flag.returncode == 2
    assert bad_flag.stderr.splitlines()[-1] == "Error: Invalid value for '--log-format': 'xml' is not one of text, json"
    bad_env = serve(MLXD_LOG_FORMAT="yaml")
    assert bad_env.returncode == 2 and "Invalid value for $MLXD_LOG_FORMAT: 'yaml'" in bad_env.stderr
    bad_level = serve(MLXD_LOG_LEVEL="loud")
    assert (bad_level.returncode, bad_level.stderr) == (1, "Error: $MLXD_LOG_LEVEL: Unknown level: 'LOUD'\n")
