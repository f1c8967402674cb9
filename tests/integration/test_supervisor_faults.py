"""Supervisor behaviour with a fake engine that crashes at boot, hangs, or exits mid-stream."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support import fake_supervisor, http10_post, httpx, wait_for


def test_each_engine_gets_its_model_s_batch_width_else_the_pool_s(tmp_path: Path) -> None:
    scanned = tmp_path / "data" / "models" / "scanned"  # in mlxd's models dir, not in the config
    scanned.mkdir(parents=True)
    (scanned / "config.json").write_text("{}")
    (scanned / "model.safetensors").write_bytes(b"")
    sup = fake_supervisor(tmp_path, "ok", "batch = 2\n[pool]\nbatch = 3\n")  # the first line ends [models.fake]
    try:
        for model in ("fake", "scanned"):
            assert sup.client.post("/admin/load", json={"model": model}).status_code == 200
        rows = sup.client.get("/admin/engines").json()["data"]
        assert {r["model"]: r["batch"] for r in rows} == {"fake": 2, "scanned": 3}
        assert re.findall(r"\[(\w+)\] fake: --batch (\w+)", sup.log()) == [("fake", "2"), ("scanned", "3")]
    finally:
        sup.stop()
    (tmp_path / "auto").mkdir()
    auto = fake_supervisor(tmp_path / "auto", "ok")  # no width anywhere: auto
    try:
        assert auto.client.post("/admin/load", json={"model": "fake"}).status_code == 200
        assert [r["batch"] for r in auto.client.get("/admin/engines").json()["data"]] == ["auto"]
        assert re.findall(r"\[(\w+)\] fake: --batch (\w+)", auto.log()) == [("fake", "auto")]
    finally:
        auto.stop()


def test_crash_at_boot_backs_off_then_marks_the_model_failed(tmp_path: Path) -> None:
    sup = fake_supervisor(tmp_path, "boot_crash")
    try:
        answers = [sup.client.post("/v1/completions", json={"model": "fake", "prompt": "x"}) for _ in range(6)]
        codes = [a.json()["error"]["code"] for a in answers]
        assert codes[:5] == ["model_load_failed"] * 5
        assert codes[5] == "model_failed"
        assert [a.headers["Retry-After"] for a in answers[:4]] == ["1"] * 4
        # The fifth failed start fails the model: tried again after the 15 s cool-down.
        assert 10 <= int(answers[4].headers["Retry-After"]) <= 15
        assert 10 <= int(answers[5].headers["Retry-After"]) <= 15
        assert len(re.findall(r"engine pid \d+ starting", sup.log())) == 5
        assert "cannot start on cue" in sup.client.post("/v1/completions", json={"model": "fake"}).json()["error"]["message"]
    finally:
        sup.stop()


def test_a_crash_loop_fails_the_model_which_heals_by_itself_after_a_doubling_cool_down(tmp_path: Path) -> None:
    """systemd-style restart limits: 3 failed starts fail the model; it answers 503 with
    Retry-After, and serves again by itself after the cool-down (3 s). A later failure cools
    down twice as long; an admin load ends a cool-down at once."""
    cue = tmp_path / "cue"
    cue.write_text("1")  # each start exits 1: a crash
    pool = "\n[pool]\ncrash_limit = 3\ncooldown_s = 3\ncooldown_max_s = 60\n"
    sup = fake_supervisor(tmp_path, "cued", pool, MLXD_FAKE_CUE=str(cue))

    def ask() -> httpx.Response:
        return sup.client.post("/v1/completions", json={"model": "fake", "prompt": "x"})

    def fake() -> dict[str, Any]:
        return dict(sup.client.get("/admin/engines").json()["data"][0])

    try:
        assert [ask().json()["error"]["code"] for _ in range(3)] == ["model_load_failed"] * 3
        failed = ask()
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "model_failed"
        assert 1 <= int(failed.headers["Retry-After"]) <= 3
        info = fake()
        assert info["state"] == "failed" and 0 <= info["retry_in_s"] <= 3 and info["retry_at"] > time.time() - 1
        cue.unlink()  # mended: the next try after the cool-down serves
        assert wait_for(lambda: ask().status_code == 200, 30), sup.log()
        assert fake()["state"] == "ready" and fake()["retry_in_s"] is None
        assert len(re.findall(r"engine pid \d+ starting", sup.log())) == 4

        cue.write_text("4")  # MODEL_LOAD_ERROR: a restart can't help, so failed at once
        sup.client.post("/admin/unload", json={"model": "fake"})
        assert ask().json()["error"]["code"] == "model_load_failed"
        info = fake()
        assert info["state"] == "failed" and info["retry_in_s"] > 3  # 6 s: the second failure in a row
        assert 3 < int(ask().headers["Retry-After"]) <= 6
        cue.unlink()
        loaded = sup.client.post("/admin/load", json={"model": "fake"})  # no waiting out the cool-down
        assert loaded.status_code == 200 and loaded.json()["state"] == "ready"
        assert ask().status_code == 200
    finally:
        sup.stop()


@pytest.mark.parametrize("mode", ["ok", "bad_drain"])
def test_an_engines_drain_report_is_read_as_its_type_and_a_malformed_one_is_dropped(tmp_path: Path, mode: str) -> None:
    sup = fake_supervisor(tmp_path, mode)
    try:
        assert sup.client.post("/v1/completions", json={"model": "fake", "prompt": "x"}).status_code == 200
        resp = sup.client.post("/admin/drain", json={"model": "fake"})
        assert resp.status_code == 200
        drained = resp.json()["drained"]
        if mode == "ok":
            assert drained == [{"model": "fake", "drained": True, "finished": 0, "cancelled": 0, "waited_ms": 0.5,
                                "cache_written_bytes": 0, "resumed": True, "cache_written_entries": 0,
                                "cache_write_ms": 0.0, "cache_complete": True}]
        else:
            assert drained == []
            assert "drain failed" in sup.log()
        assert sup.client.post("/v1/completions", json={"model": "fake", "prompt": "x"}).status_code == 200
    finally:
        sup.stop()


def test_hung_engine_is_killed_and_its_request_gets_a_clean_error(tmp_path: Path) -> None:
    sup = fake_supervisor(tmp_path, "hang", "resume = false")  # resumed, it would hang the next engine too (test_resume.py)
    try:
        started = time.monotonic()
        resp = sup.client.post("/v1/completions", json={"model": "fake", "prompt": "x"})
        assert resp.status_code == 502
        assert resp.json()["error"]["code"] == "engine_crashed"
        assert time.monotonic() - started < 10
        assert "stopped answering its health check" in sup.log()
    finally:
        sup.stop()


def test_engine_exiting_mid_stream_gives_an_sse_error_and_metrics_count_the_restart(tmp_path: Path) -> None:
    sup = fake_supervisor(tmp_path, "exit_midway")
    try:
        with sup.client.stream("POST", "/v1/completions", json={"model": "fake", "stream": True, "max_tokens": 10}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert len(lines) == 4
        assert json.loads(lines[-1][6:])["error"]["code"] == "engine_crashed"
        # The stream ends as the socket closes; the owner task reaps the exit, and the
        # middleware counts the request, a moment later.
        expected = [
            'mlxd_engine_restarts_total{model="fake"} 1.0',
            'mlxd_requests_total{model="fake",route="/v1/completions",status="200"} 1.0',
            'mlxd_time_to_first_token_seconds_count{model="fake"} 1.0',
            'mlxd_engine_state{model="fake",state="stopped"} 1.0',
        ]
        wait_for(lambda: all(line in sup.client.get("/metrics").text for line in expected), 5, interval=0.05,
                 message=lambda: sup.client.get("/metrics").text)
    finally:
        sup.stop()


def test_a_request_meeting_a_dying_engines_refusal_waits_for_its_exit_and_is_served_by_the_next(
        tmp_path: Path) -> None:
    """An engine whose sockets closed but whose process lingers (as a GPU process killed with its
    memory in use does while its driver tears down): the supervisor still counts it ready, so a
    request finds its socket refusing. It waits for the exit and the restart, not a 503."""
    # a health deadline past the linger: the process exits by itself, not killed as hung
    sup = fake_supervisor(tmp_path, "lingering_exit", MLXD_FAKE_LINGER_S="3", MLXD_ENGINE_HEALTH_DEADLINE_S="10")
    try:
        with sup.client.stream("POST", "/v1/completions", json={"model": "fake", "stream": True, "max_tokens": 10}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert json.loads(lines[-1][6:])["error"]["code"] == "engine_crashed"
        [row] = sup.client.get("/admin/engines").json()["data"]
        assert row["state"] == "ready"  # the process lingers: its exit is not seen yet
        started = time.monotonic()
        resp = sup.client.post("/v1/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": "hi"}]})
        waited = time.monotonic() - started
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == "fake"
        assert waited > 1.0  # it waited out the linger (3 s from the stream's end)
        [after] = sup.client.get("/admin/engines").json()["data"]
        assert after["pid"] != row["pid"] and after["restarts"] == 1
        assert "engine exited with 1" in sup.log()  # the linger's end, not a kill
    finally:
        sup.stop()


def test_a_slow_reader_pauses_the_engine_and_still_gets_every_chunk_in_order(tmp_path: Path) -> None:
    """4000 chunks of 8 KiB (about 33 MB) from an engine that writes as fast as it can, to a
    client that stops reading for a while: the supervisor stops reading the engine instead of
    buffering the stream, and nothing is lost or reordered when the client reads on."""
    sup = fake_supervisor(tmp_path, "flood")
    try:
        sup.client.post("/v1/completions", json={"model": "fake"})  # the engine is up: its start is not measured
        supervisor = psutil.Process(sup.proc.pid)
        rss_before = supervisor.memory_info().rss
        body = {"model": "fake", "stream": True, "max_tokens": 4000}
        with sup.client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            time.sleep(1.5)  # the engine could send it all in this time if nothing pushed back
            grown_mb = (supervisor.memory_info().rss - rss_before) / 2**20
            rest = [line for line in lines if line.startswith("data: ")]
        numbers = [json.loads(line[6:])["i"] for line in [first, *rest[:-1]]]
        assert numbers == list(range(4000))
        assert rest[-1] == "data: [DONE]"
        assert grown_mb < 12, f"supervisor grew {grown_mb:.1f} MB while the client was not reading"
    finally:
        sup.stop()


def test_an_http10_client_gets_a_clean_stream(tmp_path: Path) -> None:
    """HTTP/1.0 (nginx's default upstream protocol) has no chunked encoding: the stream's body
    runs to the close, and must carry the engine's events without its chunk framing."""
    sup = fake_supervisor(tmp_path, "ok")
    try:
        body = json.dumps({"model": "fake", "stream": True, "max_tokens": 6}).encode()
        head, payload = http10_post(sup.port, "/v1/completions", body)
        assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower()
        events = [e for e in payload.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        texts = [json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:-1]]
        assert texts == [f"t{i} " for i in range(6)]
    finally:
        sup.stop()


def test_a_burst_of_400_streams_all_complete(tmp_path: Path) -> None:
    """More requests at once than an engine's listen backlog (128 here, and on macOS): the
    supervisor keeps at most 100 connected to the engine at once, so none is refused. And
    more at once than the pool's queue holds (8 here): a ready engine admits them as they come,
    so none is turned away as `queue_full`."""
    import asyncio

    import aiohttp

    sup = fake_supervisor(tmp_path, "ok", "\n[pool]\nmax_queue = 8\n")

    async def one(session: aiohttp.ClientSession) -> int | str:
        body = {"model": "fake", "stream": True, "max_tokens": 5}
        async with session.post(sup.url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return sum([line.startswith(b"data: {") async for line in resp.content])

    async def burst() -> list[int | str]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await one(session)  # the engine is up before the burst
            return list(await asyncio.gather(*(one(session) for _ in range(400))))

    try:
        got = asyncio.run(burst())
        assert [g for g in got if g != 5] == []
    finally:
        sup.stop()
