"""A real `mlxd serve` with real engines: routing, crash isolation, auth, shutdown."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from tests.support import NO_EOS, SupervisorProcess, serving, wait_for

LONG = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 3000, "logit_bias": {"2": -100}}


@pytest.fixture(scope="module")
def sup(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    config = f'[server]\nmax_body_bytes = 65536\n\n[models.tiny]\npath = "{tiny_model}"\n'
    proc = SupervisorProcess(config, tmp_path_factory.mktemp("sup")).wait_up()
    yield proc
    proc.stop()


NO_RESUME = {"X-MLXD-Resume": "off"}


def engine_pids(sup: SupervisorProcess) -> list[int]:
    children = psutil.Process(sup.proc.pid).children()
    # An engine names itself `mlxd engine MODEL` (setproctitle) once it has its model.
    return [c.pid for c in children if " ".join(c.cmdline()).startswith(("mlxd engine", sys.executable))]


def test_openai_sdk_through_the_supervisor(sup: SupervisorProcess) -> None:
    client = sup.openai()
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, logit_bias=NO_EOS)
    assert out.usage is not None and out.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True, logit_bias=NO_EOS,
        stream_options={"include_usage": True},
    ))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    listed = {m.id: m for m in client.models.list()}
    assert listed["tiny"].model_extra == {**(listed["tiny"].model_extra or {}), "loaded": True, "state": "ready"}


def test_missing_model_uses_the_only_configured_one(sup: SupervisorProcess) -> None:
    resp = sup.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 200
    assert resp.json()["model"] == "tiny"


def test_unknown_model_is_404_listing_what_exists(sup: SupervisorProcess) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        sup.openai().chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found"
    assert "tiny" in info.value.message


@pytest.mark.parametrize(("body", "status"), [(b"{", 400), (b'{"model": 5}', 400), (b"x" * 70000, 413)])
def test_bad_bodies_get_openai_errors(sup: SupervisorProcess, body: bytes, status: int) -> None:
    resp = sup.client.post("/v1/chat/completions", content=body)
    assert resp.status_code == status
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_route_is_404_json(sup: SupervisorProcess) -> None:
    resp = sup.client.get("/v2/whatever")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"


def test_engine_sigkill_mid_stream_ends_the_stream_cleanly_and_the_next_request_works(sup: SupervisorProcess) -> None:
    # The caller opts out of resume (test_resume.py has the reply going on instead)
    with sup.client.stream("POST", "/v1/completions", json={**LONG, "stream": True}, headers=NO_RESUME) as resp:
        lines = resp.iter_lines()
        first = [next(lines) for _ in range(3)]
        [pid] = engine_pids(sup)
        killed = time.monotonic()
        psutil.Process(pid).kill()
        rest = list(lines)
    assert time.monotonic() - killed < 5
    events = [json.loads(line[6:]) for line in first + rest if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "engine_crashed"
    assert "data: [DONE]" not in rest
    again = sup.client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert again.status_code == 200, (again.text, sup.log()[-3000:])
    assert engine_pids(sup) != [pid]


def test_engine_sigkill_during_a_plain_request_is_a_502_with_retry_after(sup: SupervisorProcess) -> None:
    sup.client.post("/v1/completions", json={"model": "tiny", "prompt": "warm", "max_tokens": 1})
    [pid] = engine_pids(sup)
    import threading

    threading.Timer(0.5, lambda: psutil.Process(pid).kill()).start()
    started = time.monotonic()
    resp = sup.client.post("/v1/completions", json=LONG, headers=NO_RESUME)
    assert time.monotonic() - started < 5
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "engine_crashed"
    assert resp.headers["retry-after"] == "1"


def test_model_that_cannot_load_is_a_clear_503_not_a_restart_storm(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    (broken / "model.safetensors").write_bytes(b"junk")
    sup = SupervisorProcess(f'[models.broken]\npath = "{broken}"\n', tmp_path / "data").wait_up()
    try:
        first = sup.client.post("/v1/completions", json={"model": "broken", "prompt": "hi"})
        assert first.status_code == 503
        assert first.json()["error"]["code"] == "model_load_failed"
        started = time.monotonic()
        second = sup.client.post("/v1/completions", json={"model": "broken", "prompt": "hi"})
        assert second.status_code == 503 and second.json()["error"]["code"] == "model_failed"
        assert time.monotonic() - started < 1.0
        assert len(re.findall(r"engine pid \d+ starting", sup.log())) == 1
        assert "Traceback" not in first.text
    finally:
        sup.stop()


def test_api_keys_are_required_when_configured(tiny_model: Path, tmp_path: Path) -> None:
    config = f'[server]\napi_keys = ["sekret"]\n\n[models.tiny]\npath = "{tiny_model}"\n'
    sup = SupervisorProcess(config, tmp_path).wait_up()
    try:
        assert sup.client.get("/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            sup.openai("wrong").models.list()
        assert sup.client.get("/v1/models", headers={"x-api-key": "sekret"}).status_code == 200
        assert [m.id for m in sup.openai("sekret").models.list()] == ["tiny"]
    finally:
        sup.stop()


def serve_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "mlxd", "serve", "--data-dir", str(tmp_path), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_non_loopback_bind_without_keys_refuses_to_start(tmp_path: Path) -> None:
    (tmp_path / "empty.toml").write_text("")
    out = serve_cli(tmp_path, "--host", "0.0.0.0", "--port", "1", "--config", str(tmp_path / "empty.toml"))
    assert out.returncode == 1
    assert "--insecure-no-auth" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("toml", "expected"),
    [(None, "config file not found"), ("[server]\nprot = 1\n", "server.prot"), ("[server]\nport = 'x'\n", "server.port")],
)
def test_bad_config_stops_startup_naming_file_and_key(tmp_path: Path, toml: str | None, expected: str) -> None:
    cfg = tmp_path / "mlxd.toml"
    if toml is not None:
        cfg.write_text(toml)
    out = serve_cli(tmp_path, "--config", str(cfg))
    assert out.returncode == 1
    assert str(cfg) in out.stderr and expected in out.stderr
    assert "Traceback" not in out.stderr


def test_sigterm_stops_engines_and_removes_their_sockets(tiny_model: Path, tmp_path: Path) -> None:
    with serving(tiny_model, "tiny", tmp_path) as sup:
        sup.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        [pid] = engine_pids(sup)
        assert sup.stop() == 0
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert list(sup.runtime.glob("*.sock")) == []


def is_running(pid: int) -> bool:
    """Whether the process lives (a zombie has exited); it may be reaped as we look."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigkill_of_the_supervisor_takes_engines_down_within_2s(tiny_model: Path, tmp_path: Path) -> None:
    """The engine gets the parent-death SIGTERM more than once (once per reparenting: to each
    of the supervisor's threads, then to init); a repeat must not cut its exit short before it
    removes its socket (mlxd/engine/server.py run)."""
    sup = SupervisorProcess(f'[models.tiny]\npath = "{tiny_model}"\n', tmp_path).wait_up()
    assert sup.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    [pid] = engine_pids(sup)
    if sys.platform.startswith("linux"):  # named, so an engine slow to start cannot mistake init for us
        assert f"MLXD_PARENT_PID={sup.proc.pid}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    sup.proc.send_signal(signal.SIGKILL)
    sup.proc.wait()
    wait_for(lambda: not is_running(pid), 2.0, interval=0.02, message="engine outlived the supervisor by 2 s")
    sup.stop()
    assert not list(sup.runtime.glob("e-*.sock"))  # the engine removed its own on the way out
    stale = sup.runtime / "e-0123456789ab.sock"  # as a SIGKILLed engine would leave it
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(stale))
    again = SupervisorProcess(f'[models.tiny]\npath = "{tiny_model}"\n', tmp_path / "again", runtime=sup.runtime)
    again.wait_up()
    assert "removed 1 stale engine socket" in again.log()
    assert not stale.exists()
    assert again.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    again.stop()


def test_the_supervisor_never_imports_mlx() -> None:
    code = (
        "import sys, mlxd.cli.main, mlxd.cli.serve_cmds, mlxd.cli.service.cmds, mlxd.supervisor.server\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'transformers')]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_concurrent_first_requests_start_exactly_one_engine(tiny_model: Path, tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with serving(tiny_model, "tiny", tmp_path) as sup:
        def ask(i: int) -> int:
            body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": 3}
            return sup.client.post("/v1/completions", json=body).status_code

        with ThreadPoolExecutor(6) as pool:
            assert list(pool.map(ask, range(6))) == [200] * 6
        assert len(re.findall(r"engine pid \d+ starting", sup.log())) == 1
        assert len(engine_pids(sup)) == 1


def test_client_disconnect_through_the_supervisor_cancels_the_engine(sup: SupervisorProcess) -> None:
    sup.client.post("/v1/completions", json={"model": "tiny", "prompt": "warm", "max_tokens": 1})
    before = sup.engine_stats("tiny")["requests"]["cancelled"]
    with sup.client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
    wait_for(lambda: sup.engine_stats("tiny")["requests"]["cancelled"] != before, 3, interval=0.05,
             message="the engine kept generating for a client that left")
    last = sup.engine_stats("tiny")["last"]
    assert last["finish_reason"] == "cancelled"


def test_two_models_and_eight_concurrent_streams(tiny_model: Path, tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    config = f'[models.a]\npath = "{tiny_model}"\n\n[models.b]\npath = "{tiny_model}"\n'
    sup = SupervisorProcess(config, tmp_path).wait_up()
    client = sup.openai()
    try:
        def stream(i: int) -> int:
            chunks = client.chat.completions.create(
                model="ab"[i % 2], messages=[{"role": "user", "content": f"stream {i}"}], max_tokens=8,
                stream=True, logit_bias=NO_EOS, stream_options={"include_usage": True},
            )
            return next(c for c in chunks if c.usage).usage.completion_tokens  # type: ignore[union-attr]

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(stream, range(8))) == [8] * 8
        assert len(engine_pids(sup)) == 2
        states = sup.client.get("/health").json()["engines"]
        assert states == {"a": "ready", "b": "ready"}
    finally:
        sup.stop()


@pytest.mark.skipif(not hasattr(psutil.Process, "rlimit"), reason="psutil reads another process's limits on Linux only")
def test_a_low_open_file_limit_is_raised_at_start(tiny_model: Path, tmp_path: Path) -> None:
    """Started with macOS's default of 256 open files, the supervisor and its engines run
    with as many as the hard limit allows, up to 65536."""
    import resource

    from mlxd.fdlimit import target_soft_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        sup = SupervisorProcess(f'[models.tiny]\npath = "{tiny_model}"\n', tmp_path)  # inherits 256
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        sup.wait_up()
        assert sup.client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1}).status_code == 200
        expected = target_soft_limit(256, hard, infinity=resource.RLIM_INFINITY)
        assert expected > 256
        assert psutil.Process(sup.proc.pid).rlimit(resource.RLIMIT_NOFILE)[0] == expected
        # The engine's own raise comes after importing mlx-lm, which sets (2048, 4096) itself.
        (engine,) = engine_pids(sup)
        engine_soft, engine_hard = psutil.Process(engine).rlimit(resource.RLIMIT_NOFILE)
        assert engine_soft == target_soft_limit(256, engine_hard, infinity=resource.RLIM_INFINITY) > 256
    finally:
        sup.stop()


def test_a_translated_streams_time_to_first_token_is_not_its_first_keep_alive(tiny_model: Path, tmp_path: Path) -> None:
    """An Anthropic stream that waits in the engine gets keep-alives before its answer: its
    access-log TTFT (and the TTFT histogram) is when the answer began, not the first keep-alive."""
    config = f'[server]\nstream_keepalive_s = 0.2\n\n[models.tiny]\npath = "{tiny_model}"\nbatch = 1\n'
    proc = SupervisorProcess(config, tmp_path).wait_up()
    try:
        assert proc.client.post("/admin/load", json={"model": "tiny"}).status_code == 200
        holder = threading.Thread(target=lambda: proc.client.post("/v1/completions", json={**LONG, "max_tokens": 2000}))
        holder.start()
        assert wait_for(lambda: proc.engine_stats("tiny")["admission"]["in_flight"] > 0, 10)
        body = {"model": "tiny", "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        started, first_text, pings = time.perf_counter(), None, 0
        with proc.client.stream("POST", "/v1/messages", json=body) as resp:
            for line in resp.iter_lines():
                pings += line.startswith(":")
                if first_text is None and line.startswith("event: content_block_delta"):
                    first_text = time.perf_counter() - started
        holder.join(60)
        assert first_text is not None and pings >= 2  # it waited through keep-alives
        line = wait_for(lambda: next((x for x in proc.log().splitlines() if "POST /v1/messages 200" in x), None), 10)
        ttft_ms = int(re.search(r"ttft=(\d+)ms", line).group(1))  # type: ignore[union-attr]
        assert ttft_ms >= first_text * 1000 * 0.8, (line, first_text)
    finally:
        proc.stop()


def test_stream_queued_inside_the_engine_gets_comments_through_the_relay(tiny_model: Path, tmp_path: Path) -> None:
    config = f'[server]\nstream_keepalive_s = 0.2\n\n[models.tiny]\npath = "{tiny_model}"\nbatch = 1\n'  # one at a time: the second waits
    proc = SupervisorProcess(config, tmp_path).wait_up()
    try:
        assert proc.client.post("/admin/load", json={"model": "tiny"}).status_code == 200
        long_lines: list[str] = []

        def long_stream() -> None:
            with proc.client.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 1000, "stream": True}) as r:
                long_lines.extend(r.iter_lines())

        holder = threading.Thread(target=long_stream)
        holder.start()
        assert wait_for(lambda: len(long_lines) > 0 or proc.engine_stats("tiny")["admission"]["in_flight"] > 0, 10)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True, "logit_bias": NO_EOS}
        with proc.client.stream("POST", "/v1/completions", json=body) as resp:
            lines = [line for line in resp.iter_lines() if line]
        holder.join(60)
        data = [i for i, line in enumerate(lines) if line.startswith("data: ")]
        comments = [i for i, line in enumerate(lines) if line.startswith(":") and not line.startswith(": mlxd-usage ")]
        assert comments and comments[0] < data[0]  # the engine's keep-alives, relayed while it waited
        assert all(i < data[0] for i in comments)
        assert lines[-2].startswith(": mlxd-usage ")  # the engine's report, passed on (SSE clients skip it)
        assert lines[-1] == "data: [DONE]"
        assert [line for line in long_lines if line][-1] == "data: [DONE]"
    finally:
        proc.stop()
