"""An engine group with a rank on "another host" (issue 30, docs/distributed.md): `mlxd rank`,
the agent a second machine runs, started here on 127.0.0.1, and a supervisor whose model lists
it in `hosts`. The agent starts rank 1 for the supervisor that proves it holds the key, relays
its log, and kills it when the supervisor lets go; rank 0 takes it over TCP with the group's
token."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxd.protocol.exit_codes import ExitCode
from tests.support import NO_EOS, free_port, pid_alive, port_open, serving, terminate, wait_for


def key_file(path: Path, key: str) -> Path:
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


@contextlib.contextmanager
def rank_agent(tmp_path: Path, key: Path, *flags: str) -> Iterator[tuple[int, Path]]:
    """`mlxd rank` on 127.0.0.1: its port and log."""
    port, log = free_port(), tmp_path / f"agent-{free_port()}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlxd", "rank", "--listen", f"127.0.0.1:{port}",
                                 "--key-file", str(key), *flags], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "MLXD_DATA_DIR": str(tmp_path / "agent-data")})
    try:
        wait_for(lambda: port_open(port) or proc.poll() is not None, 30)
        assert proc.poll() is None, log.read_text()
        yield port, log
    finally:
        terminate(proc, 10)


def spread(port: int, key: Path) -> str:
    return f'batch = 4\ndistributed = {{ranks = 2, hosts = ["127.0.0.1", "127.0.0.1:{port}"], key_file = "{key}"}}'


def rank_pids(log: Path) -> list[int]:
    return [int(p) for p in re.findall(r"rank 1 pid (\d+) starting", log.read_text())]



BODY: dict[str, Any] = {"model": "tiny", "max_tokens": 24, "temperature": 0, "logit_bias": NO_EOS,
                        "messages": [{"role": "user", "content": "Tell me about the sea."}]}


def test_a_rank_on_another_host_serves_restarts_and_goes_with_its_supervisor(tiny_model: Path, tmp_path: Path) -> None:
    key = key_file(tmp_path / "rank.key", "0123456789abcdef0123456789abcdef")
    with serving(tiny_model, "tiny", tmp_path / "alone", model_config="batch = 4") as alone:
        want = alone.client.post("/v1/chat/completions", json=BODY).json()["choices"][0]["message"]["content"]
        [row] = alone.client.get("/admin/engines").json()["data"]
        alone_estimate = row["memory_estimate_bytes"]
        assert row["hosts"] is None
    with rank_agent(tmp_path, key) as (port, agent_log), \
            serving(tiny_model, "tiny", tmp_path / "data", model_config=spread(port, key)) as sup:
        answer = sup.client.post("/v1/chat/completions", json=BODY)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == want
        assert f"[tiny] rank 1 starting on 127.0.0.1:{port}" in sup.log()
        assert "[tiny rank 1]" in sup.log() and "rank 1 of 2 (ring, tensor)" in sup.log()  # its log, relayed
        [row] = sup.client.get("/admin/engines").json()["data"]
        [host] = row["hosts"]  # the other host's memory, as its agent said
        assert host["rank"] == 1 and host["host"] == f"127.0.0.1:{port}"
        assert 0 < host["memory_available"] <= host["memory_total"]
        assert row["memory_estimate_bytes"] < alone_estimate  # this machine books rank 0's part only
        [first] = rank_pids(agent_log)
        os.kill(first, signal.SIGKILL)  # the remote rank dies: the group ends and starts again, both hosts
        wait_for(lambda: f"[tiny] engine exited with {ExitCode.GPU_THREAD_DIED}" in sup.log(), 30, message=sup.log)
        again = sup.client.post("/v1/chat/completions", json=BODY)
        assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == want
        second = rank_pids(agent_log)[-1]
        assert second != first
        assert sup.client.post("/admin/unload", json={"model": "tiny"}).json()["state"] == "stopped"
        wait_for(lambda: not pid_alive(second), 10, message=agent_log.read_text)  # the agent killed it
        sup.client.post("/v1/chat/completions", json=BODY)
        third = rank_pids(agent_log)[-1]
        sup.stop()
        wait_for(lambda: not pid_alive(third), 10, message=agent_log.read_text)  # no rank outlives its supervisor


FAILURES = {"wrong key": "refused us: wrong key", "no agent": "is `mlxd rank` running there?",
            "no memory": "has 0.0 GB of memory free, and its part of the model needs about"}


@pytest.mark.parametrize("case", list(FAILURES))
def test_a_host_that_cannot_take_its_rank_fails_the_load_naming_it(tiny_model: Path, tmp_path: Path, case: str) -> None:
    ours = key_file(tmp_path / "rank.key", "0123456789abcdef0123456789abcdef")
    theirs = key_file(tmp_path / "other.key", "fedcba9876543210fedcba9876543210") if case == "wrong key" else ours
    flags = ("--memory-gb", "0.000001") if case == "no memory" else ()  # the host gives ranks 1 KB
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(rank_agent(tmp_path, theirs, *flags))[0] if case != "no agent" else free_port()
        sup = stack.enter_context(serving(tiny_model, "tiny", tmp_path / "data", model_config=spread(port, ours)))
        answer = sup.client.post("/v1/chat/completions", json=BODY)
        assert answer.status_code == 503
        error = answer.json()["error"]
        assert error["code"] == "model_load_failed"
        assert f"rank 1's host 127.0.0.1:{port}" in error["message"]
        assert FAILURES[case] in error["message"]
