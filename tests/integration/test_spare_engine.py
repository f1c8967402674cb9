"""`python -m mlxd.engine --spare`: imports first, then its command line from stdin."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil

from mlxd.protocol.exit_codes import ExitCode
from tests.support import engine_env, httpx, is_listening, private_socket_dir, terminate, wait_for


@contextlib.contextmanager
def spawn_spare() -> Iterator[subprocess.Popen[bytes]]:
    with subprocess.Popen(
        [sys.executable, "-m", "mlxd.engine", "--spare"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, env=engine_env(),
    ) as spare:
        try:
            yield spare
        finally:
            terminate(spare, 10)


def title(pid: int) -> str:
    """The process title `ps` shows (setproctitle pads argv's memory with NULs: empty args)."""
    return " ".join(arg for arg in psutil.Process(pid).cmdline() if arg)


def test_a_spare_serves_the_model_it_is_given(tiny_model: Path) -> None:
    with spawn_spare() as spare:
        assert spare.stdout is not None and spare.stdin is not None
        assert spare.stdout.readline().decode().strip() == "spare engine: imports done"
        assert title(spare.pid) == "mlxd engine (spare)"
        sock = private_socket_dir() / "s.sock"
        argv = ["--model", str(tiny_model), "--model-id", "tiny", "--socket", str(sock)]
        spare.stdin.write(json.dumps(argv).encode() + b"\n")
        spare.stdin.close()
        transport = httpx.HTTPTransport(uds=str(sock))
        with httpx.Client(transport=transport, base_url="http://engine", timeout=60) as client:
            assert wait_for(lambda: is_listening(sock) and client.get("/health").json()["status"] == "ready", 60,
                            interval=0.05)
            out = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert out.status_code == 200 and out.json()["model"] == "tiny"
        assert title(spare.pid) == "mlxd engine tiny"  # not `... --spare` any more


def test_a_spare_whose_parent_closes_stdin_exits() -> None:
    with spawn_spare() as spare:
        assert spare.stdout is not None and spare.stdin is not None
        spare.stdout.readline()
        spare.stdin.close()
        assert spare.wait(30) == ExitCode.PARENT_GONE


def test_a_spare_given_garbage_exits_with_a_boot_error() -> None:
    with spawn_spare() as spare:
        assert spare.stdout is not None and spare.stdin is not None
        spare.stdout.readline()
        spare.stdin.write(b'{"not": "a list"}\n')
        spare.stdin.close()
        assert spare.wait(30) == ExitCode.ENGINE_BOOT_ERROR
