"""The engine's admission gate on real engines: POST /admin/drain, POST /admin/lease, and bad bodies."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from tests.support import EngineProcess, running_engine, wait_for

MSG = [{"role": "user", "content": "Write forever"}]
LEASE = "X-MLXD-Lease"
# The tiny model decodes ~450 tokens/s here: 800 tokens outlast the test's own steps by ~1.5 s.
SHORT_STREAM = {"messages": MSG, "max_tokens": 800, "temperature": 0, "stream": True}
LONG = {"messages": MSG, "max_tokens": 3500, "temperature": 0}


def gate(engine: EngineProcess) -> dict[str, Any]:
    return engine.stats()["admission"]  # type: ignore[no-any-return]


def complete(engine: EngineProcess, token: str | None = None) -> httpx.Response:
    headers = {LEASE: token} if token else {}
    return engine.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=headers)


def error_of(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


def assert_refused(resp: httpx.Response, code: str) -> None:
    assert resp.status_code == 503, resp.text
    assert resp.headers["retry-after"] == "1"
    err = error_of(resp)
    assert (err["type"], err["code"], err["param"]) == ("server_error", code, None)


def data_events(lines: Iterator[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line]


# ---- drain ----


def test_drain_lets_a_running_stream_finish_then_resumes(engine: EngineProcess) -> None:
    before = engine.stats()
    with engine.client.stream("POST", "/v1/chat/completions", json=SHORT_STREAM) as stream, ThreadPoolExecutor(1) as pool:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # generating now
        drain = pool.submit(engine.client.post, "/admin/drain", json={"timeout_s": 30, "resume": True})
        assert wait_for(lambda: gate(engine)["state"] == "draining")
        assert engine.client.get("/health").json()["status"] == "draining"
        assert_refused(complete(engine), "draining")
        assert data_events(lines)[-1] == "[DONE]"
        result = drain.result().json()
    assert result["finished"] == 1 and result["cancelled"] == 0
    assert result["drained"] is True and result["resumed"] is True and result["cache_complete"] is True
    assert isinstance(result["waited_ms"], float) and result["waited_ms"] > 0
    # The finished stream's KV is on SSD when the drain answers (written by it, or just before
    # by the idle engine's write-behind).
    cache = engine.stats()["prompt_cache"]
    assert cache["writes_pending"] == 0 and cache["ssd"]["writes"] >= 1 and cache["ssd"]["entries"] >= 1
    after = engine.stats()
    assert after["requests"]["total"] == before["requests"]["total"] + 1  # the refusal is not a request
    assert after["admission"]["rejected_draining"] == before["admission"]["rejected_draining"] + 1
    assert after["admission"]["state"] == "open" and after["admission"]["in_flight"] == 0
    assert engine.client.get("/health").json()["status"] == "ready"
    assert complete(engine).status_code == 200


def test_drain_timeout_aborts_a_stream_and_a_queued_request(engine: EngineProcess) -> None:
    with engine.client.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as stream, ThreadPoolExecutor(2) as pool:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        queued = pool.submit(engine.client.post, "/v1/chat/completions", json=LONG)
        assert wait_for(lambda: gate(engine)["in_flight"] == 2)
        # The stream is read while the drain runs: unread, ~500 events fill its socket and the
        # aborted handler stays stuck writing, so the drain times out its 5 s grace (drained: false).
        drain = pool.submit(engine.client.post, "/admin/drain", json={"timeout_s": 0.3, "resume": True})
        last = json.loads(data_events(lines)[-1])
        assert last["error"]["code"] == "drain_timeout"
        result, resp = drain.result().json(), queued.result()
    assert (result["finished"], result["cancelled"], result["drained"]) == (0, 2, True)
    assert 300 <= result["waited_ms"] < 5000
    assert resp.status_code == 503 and error_of(resp)["code"] == "drain_timeout"
    assert complete(engine).status_code == 200  # resumed


def test_drain_completes_and_resumes_when_its_caller_disconnects(engine: EngineProcess) -> None:
    line = "1 finished, 0 cancelled; resumed"
    before = engine.log().count(line)  # an earlier test's drain logged it too
    with engine.client.stream("POST", "/v1/chat/completions", json=SHORT_STREAM) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        with pytest.raises(httpx.ReadTimeout):
            engine.client.post("/admin/drain", json={"resume": True}, timeout=0.2)
        assert_refused(complete(engine), "draining")
        assert data_events(lines)[-1] == "[DONE]"
    # The drain went on without its caller: it saw the stream finish, then resumed.
    assert wait_for(lambda: engine.log().count(line) == before + 1)
    assert gate(engine)["state"] == "open"
    assert complete(engine).status_code == 200


def test_drain_without_resume_stays_draining_and_overrides_a_lease(tiny_model: Path) -> None:
    with running_engine(tiny_model, "tiny", "--max-context", "512") as engine:
        with engine.client.stream("POST", "/admin/lease", json={"holder": "job"}) as lease:
            lines = lease.iter_lines()
            token = json.loads(next(lines))["token"]
            resp = engine.client.post("/admin/drain")  # no body: the defaults
            assert resp.status_code == 200
            result = resp.json()
            assert result == {"drained": True, "finished": 0, "cancelled": 0, "waited_ms": result["waited_ms"],
                              "cache_written_bytes": 0, "resumed": False, "cache_written_entries": 0,
                              "cache_write_ms": result["cache_write_ms"], "cache_complete": True}
            health = engine.client.get("/health")
            assert (health.status_code, health.json()["status"]) == (200, "draining")
            assert_refused(complete(engine), "draining")
            assert_refused(complete(engine, token), "draining")  # the holder too
            assert json.loads(next(lines)) == {"status": "held"}  # the lease lives on: a heartbeat
        stats = engine.stats()
        assert stats["admission"]["rejected_draining"] == 2 and stats["requests"]["total"] == 0
        assert wait_for(lambda: gate(engine)["state"] == "draining" and gate(engine)["lease_holder"] is None)
        assert_refused(engine.client.post("/v1/chat/completions", json={"messages": MSG}), "draining")


# ---- lease ----


def test_lease_admits_only_its_holder_and_queues_a_second_lease(engine: EngineProcess) -> None:
    before = gate(engine)
    with ThreadPoolExecutor(1) as pool:
        with engine.client.stream("POST", "/admin/lease", json={"holder": "job-1"}) as lease:
            assert lease.status_code == 200
            assert lease.headers["content-type"] == "application/x-ndjson"
            lines = lease.iter_lines()
            held = json.loads(next(lines))
            token = held.pop("token")
            assert held == {"status": "held", "holder": "job-1"} and len(token) >= 16
            assert_refused(complete(engine), "leased")
            assert_refused(complete(engine, "not-the-token"), "leased")
            assert complete(engine, token).status_code == 200
            assert gate(engine)["state"] == "leased" and gate(engine)["lease_holder"] == "job-1"
            assert_refused(engine.client.post("/admin/lease", json={"wait_s": 0.2}), "lease_busy")
            second = pool.submit(hold_second_lease, engine, token)
            assert json.loads(next(lines)) == {"status": "held"}  # a heartbeat, a second later
            assert not second.done()  # still waiting for this lease to end
        held2, stale = second.result()
    assert held2["holder"] == "job-2" and held2["token"] != token
    assert stale == 503
    assert wait_for(lambda: gate(engine)["state"] == "open")
    assert gate(engine)["lease_holder"] is None
    assert gate(engine)["rejected_leased"] == before["rejected_leased"] + 3
    assert complete(engine).status_code == 200


def hold_second_lease(engine: EngineProcess, old_token: str) -> tuple[dict[str, Any], int]:
    """Take a lease (waiting for the current one), try the old token under it, then let go."""
    with engine.client.stream("POST", "/admin/lease", json={"holder": "job-2", "wait_s": 30}) as lease:
        lines = lease.iter_lines()  # kept: dropping the iterator closes the connection
        held = json.loads(next(lines))
        return held, complete(engine, old_token).status_code


def test_lease_waits_for_requests_in_flight(engine: EngineProcess) -> None:
    with engine.client.stream("POST", "/v1/chat/completions", json=SHORT_STREAM) as stream, ThreadPoolExecutor(1) as pool:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        assert_refused(engine.client.post("/admin/lease", json={"wait_s": 0.2}), "lease_timeout")
        assert gate(engine)["state"] == "open"  # given up: admission reopened
        lease = pool.submit(hold_lease_once, engine)
        assert wait_for(lambda: gate(engine)["state"] == "leased")
        assert_refused(complete(engine), "leased")
        assert not lease.done()
        assert data_events(lines)[-1] == "[DONE]"  # the running stream was left to finish
        assert lease.result()["status"] == "held"
    assert wait_for(lambda: gate(engine)["state"] == "open")


def hold_lease_once(engine: EngineProcess) -> dict[str, Any]:
    """Take a lease, read its first line, and let go."""
    with engine.client.stream("POST", "/admin/lease", json={"holder": "waiter", "wait_s": 30}) as lease:
        return json.loads(next(lease.iter_lines()))  # type: ignore[no-any-return]


# ---- bad bodies ----


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/admin/drain", b"{", None),
        ("/admin/drain", b"[]", None),
        ("/admin/drain", b'{"timeout_s": "x"}', "timeout_s"),
        ("/admin/drain", b'{"timeout_s": 0}', "timeout_s"),
        ("/admin/drain", b'{"resume": 1}', "resume"),
        ("/admin/drain", b'{"resume": true, "bogus": 1}', None),
        ("/admin/lease", b"not json", None),
        ("/admin/lease", b'{"holder": 3}', "holder"),
        ("/admin/lease", b'{"wait_s": -1}', "wait_s"),
    ],
)
def test_bad_admin_bodies_are_400(engine: EngineProcess, path: str, body: bytes, param: str | None) -> None:
    resp = engine.client.post(path, content=body)
    assert resp.status_code == 400
    err = error_of(resp)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    if b"bogus" in body:
        assert "bogus" in err["message"]
    assert gate(engine)["state"] == "open"
