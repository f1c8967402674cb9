"""The supervisor against hostile input: foreign hosts and origins, slow and malformed HTTP,
oversize and stalled bodies, deep JSON, and streams that wait (a fake engine behind it)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support import (
    HARDENED_CONFIG,
    HEAD_TIMEOUT_S,
    SupervisorProcess,
    fake_supervisor,
    wait_for,
)


@pytest.fixture(scope="module")
def sup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    proc = fake_supervisor(tmp_path_factory.mktemp("hardening"), config=HARDENED_CONFIG)
    try:
        yield proc
    finally:
        proc.stop()


def raw(port: int, data: bytes, *, wait_s: float = 5.0) -> tuple[bytes, float]:
    """Send `data` on a fresh connection; everything the server sends until it closes, and when it closed."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(wait_s)
        if data:
            sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            out += b"<still open>"
        except ConnectionResetError:
            pass
    return out, time.monotonic() - started


def error_of(answer: bytes) -> dict[str, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"application/json" in head
    return dict(json.loads(body)["error"])


# --- Host and Origin ------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/models", "/admin/engines", "/health", "/metrics"])
def test_dns_rebinding_host_is_refused_everywhere(sup: SupervisorProcess, path: str) -> None:
    resp = sup.client.get(path, headers={"Host": "evil.example", "Origin": "http://evil.example"})
    assert resp.status_code == 403
    assert resp.json()["error"]["code"] == "forbidden_origin"
    assert "Access-Control-Allow-Origin" not in resp.headers


def test_rebinding_inference_is_refused_before_it_reaches_an_engine(sup: SupervisorProcess) -> None:
    resp = sup.client.post("/v1/completions", json={"model": "fake", "prompt": "x"},
                           headers={"Host": f"evil.example:{sup.port}"})
    assert resp.status_code == 403
    assert "evil.example" in resp.json()["error"]["message"]


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", "mlxd.lan", "gpu.example.org", "192.168.1.20"])
def test_own_names_ip_literals_and_allowed_hosts_are_served(sup: SupervisorProcess, host: str) -> None:
    resp = sup.client.get("/v1/models", headers={"Host": f"{host}:{sup.port}"})
    assert resp.status_code == 200, resp.text


def test_cross_site_simple_post_cannot_unload(sup: SupervisorProcess) -> None:
    assert sup.client.post("/admin/load", json={"model": "fake"}).status_code == 200
    form = {"Content-Type": "text/plain", "Origin": "http://evil.example"}
    resp = sup.client.post("/admin/unload", content=b'{"model": "fake"}', headers=form)
    assert resp.status_code == 403
    # Without an Origin (a non-browser client) the JSON content type is still required.
    resp = sup.client.post("/admin/unload", content=b'{"model": "fake"}', headers={"Content-Type": "text/plain"})
    assert resp.status_code == 415
    assert resp.json()["error"]["code"] == "unsupported_media_type"
    assert sup.client.get("/admin/engines").json()["data"][0]["state"] == "ready"


def test_cross_site_fetch_metadata_without_origin_is_refused(sup: SupervisorProcess) -> None:
    resp = sup.client.get("/v1/models", headers={"Sec-Fetch-Site": "cross-site"})
    assert resp.status_code == 403
    assert sup.client.get("/v1/models", headers={"Sec-Fetch-Site": "same-origin"}).status_code == 200


@pytest.mark.parametrize("origin", ["http://app.example.com", "http://localhost:5173"])
def test_allowed_origin_gets_cors_on_answers_and_errors(sup: SupervisorProcess, origin: str) -> None:
    ok = sup.client.get("/v1/models", headers={"Origin": origin})
    assert ok.status_code == 200
    assert ok.headers["Access-Control-Allow-Origin"] == origin
    assert "Origin" in ok.headers["Vary"]
    missing = sup.client.post("/v1/completions", json={"model": "nope"}, headers={"Origin": origin})
    assert missing.status_code == 404
    assert missing.headers["Access-Control-Allow-Origin"] == origin


def test_own_origin_is_allowed(sup: SupervisorProcess) -> None:
    resp = sup.client.get("/v1/models", headers={"Origin": f"http://127.0.0.1:{sup.port}"})
    assert resp.status_code == 200


def test_preflight_answered_for_allowed_origins_refused_for_others(sup: SupervisorProcess) -> None:
    asking = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = sup.client.options("/v1/chat/completions", headers={**asking, "Origin": "http://app.example.com"})
    assert ok.status_code == 204
    assert ok.headers["Access-Control-Allow-Origin"] == "http://app.example.com"
    assert "POST" in ok.headers["Access-Control-Allow-Methods"]
    assert "authorization" in ok.headers["Access-Control-Allow-Headers"].lower()
    bad = sup.client.options("/v1/chat/completions", headers={**asking, "Origin": "http://evil.example"})
    assert bad.status_code == 403
    assert "Access-Control-Allow-Origin" not in bad.headers
    null = sup.client.options("/admin/unload", headers={**asking, "Origin": "null"})
    assert null.status_code == 403


# --- bodies and JSON ------------------------------------------------------------------------

def test_oversize_content_length_is_413_from_the_head_alone(sup: SupervisorProcess) -> None:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{sup.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {40 * 1024 * 1024}\r\n\r\n").encode()
    answer, took = raw(sup.port, head, wait_s=5)
    assert answer.startswith(b"HTTP/1.1 413")
    assert error_of(answer)["code"] == "request_too_large"
    assert took < 4


def test_stalled_body_gets_408(sup: SupervisorProcess) -> None:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{sup.port}\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n{").encode()
    answer, took = raw(sup.port, head, wait_s=20)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert error_of(answer)["code"] == "request_timeout"
    assert took < 6 * HEAD_TIMEOUT_S + 5


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/admin/load", "/admin/leases"])
def test_json_nested_1000_deep_is_a_400(sup: SupervisorProcess, path: str) -> None:
    deep = '{"model": ' + "[" * 1000 + "]" * 1000 + "}"
    resp = sup.client.post(path, content=deep, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "json_too_deep"
    deep = '{"model": "fake", "user": ' + "[" * 1000 + "]" * 1000 + "}"
    resp = sup.client.post(path, content=deep, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400


def test_json_129_deep_is_refused_and_128_is_not(sup: SupervisorProcess) -> None:
    def body(depth: int) -> str:
        return '{"model": "fake", "prompt": "x", "max_tokens": 2, "user": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"
    assert sup.client.post("/v1/completions", content=body(129)).json()["error"]["code"] == "json_too_deep"
    assert sup.client.post("/v1/completions", content=body(128)).status_code == 200


@pytest.mark.parametrize("body", [b"{", b"[1, 2]", b'{"model": 5}', b'{"model": "fake", "stream": "yes"}', b"\xff\xfe"])
def test_malformed_json_is_a_400_in_openai_format(sup: SupervisorProcess, body: bytes) -> None:
    resp = sup.client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"


# --- malformed HTTP -------------------------------------------------------------------------

MALFORMED = [
    b"HELLO WORLD\r\n\r\n",
    b"GET /health HTTP/9.9\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: a\r\nContent-Length: abc\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: a\r\nX-Long: " + b"a" * 10000 + b"\r\n\r\n",
    b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET /health HTTP/1.1\r\nBad Header Line\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: a\r\n\x00: x\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 32 + b"\r\n\r\n",  # a TLS hello
    b"GET /health HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked, identity\r\n\r\n",
]


def test_malformed_http_gets_json_without_echo_and_one_log_line_per_cause(sup: SupervisorProcess) -> None:
    before = sup.log()
    for data in MALFORMED * 2:
        answer, _ = raw(sup.port, data, wait_s=5)
        if not answer:
            continue  # a clean close where HTTP cannot be parsed at all
        assert answer.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")), (data[:40], answer[:200])
        err = error_of(answer)
        assert err["code"] == "bad_http_request"
        for echo in (b"HELLO", b"aaaaaaaa", b"zz", b"Bad Header", b"9.9", b"abc"):
            assert echo.decode() not in err["message"]
    assert wait_for(lambda: sup.log() != before, 2)
    new = sup.log()[len(before):]
    assert "Traceback" not in new
    lines = [line for line in new.splitlines() if "malformed HTTP request" in line]
    causes = [line.split("malformed HTTP request", 1)[1].split(":")[0] for line in lines]
    assert lines and len(causes) == len(set(causes)), lines  # each cause once, however often it came


# --- slow and idle connections --------------------------------------------------------------

def test_slow_heads_and_silent_connections_are_closed_on_time_while_requests_are_served(sup: SupervisorProcess) -> None:
    results: list[tuple[bytes, float]] = []

    def slow() -> None:
        sock = socket.create_connection(("127.0.0.1", sup.port))
        started = time.monotonic()
        sock.settimeout(0.3)
        answer = b""
        try:
            for byte in b"GET /health HTTP/1.1\r\nHost: localhost\r\n":
                sock.sendall(bytes([byte]))
                try:
                    if chunk := sock.recv(4096):
                        answer += chunk
                        answer += sock.recv(4096)
                    break  # closed or answered
                except TimeoutError:
                    continue
        except OSError:
            pass
        finally:
            sock.close()
        results.append((answer, time.monotonic() - started))

    threads = [threading.Thread(target=slow) for _ in range(10)]
    silent = [socket.create_connection(("127.0.0.1", sup.port)) for _ in range(5)]
    for t in threads:
        t.start()
    served = [sup.client.get("/health").status_code for _ in range(5)]
    for t in threads:
        t.join(30)
    assert served == [200] * 5
    assert len(results) == 10
    for answer, took in results:
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
        assert took < HEAD_TIMEOUT_S + 1.5
    for sock in silent:
        sock.settimeout(HEAD_TIMEOUT_S + 2)
        assert sock.recv(100) == b""  # closed by the server, with nothing to say
        sock.close()


def test_idle_keepalive_connection_is_closed(sup: SupervisorProcess) -> None:
    req = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{sup.port}\r\n\r\n".encode()
    answer, took = raw(sup.port, req, wait_s=10)
    assert answer.startswith(b"HTTP/1.1 200")
    assert b"<still open>" not in answer
    assert 1.0 < took < 6  # keepalive_timeout_s = 2 (or the head deadline for a next head: 1 s)


def num_accepted(sup: SupervisorProcess, socks: list[socket.socket]) -> int:
    """How many of `socks` the supervisor has accepted (each an fd of its own, unlike one in the backlog)."""
    ports = {sock.getsockname()[1] for sock in socks}
    return sum(bool(c.raddr) and c.raddr.port in ports for c in psutil.Process(sup.proc.pid).net_connections("tcp"))


def test_connection_cap_closes_idle_connections_first(sup: SupervisorProcess) -> None:
    idle = [socket.create_connection(("127.0.0.1", sup.port)) for _ in range(30)]
    try:
        assert wait_for(lambda: num_accepted(sup, idle) == 30)  # the supervisor holds them all, not the kernel's backlog
        assert sup.client.get("/health").status_code == 200  # the oldest idle one made room
        closed = 0
        for sock in idle:
            sock.settimeout(0.05)
            with contextlib.suppress(TimeoutError):
                closed += sock.recv(10) == b""
        assert closed >= 1
    finally:
        for sock in idle:
            sock.close()


# --- streams that wait ----------------------------------------------------------------------

def test_stream_queued_behind_a_machine_lease_gets_comments_then_its_answer(sup: SupervisorProcess) -> None:
    lease = sup.client.post("/admin/leases", json={"model": None, "ttl_s": 60}).json()
    lines: list[str] = []

    def stream() -> None:
        body = {"model": "fake", "stream": True, "max_tokens": 3}
        with sup.client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                lines.append(line)  # one by one: the test watches them come

    reader = threading.Thread(target=stream)
    reader.start()
    assert wait_for(lambda: sum(line.startswith(":") for line in lines) >= 2, 10)  # waiting, and saying so
    assert sup.client.delete(f"/admin/leases/{lease['id']}").status_code == 200
    reader.join(30)
    comments = [line for line in lines if line.startswith(":")]
    data = [line for line in lines if line.startswith("data: ")]
    assert len(comments) >= 2
    assert lines.index(comments[0]) < lines.index(data[0])
    assert data[-1] == "data: [DONE]"
    assert len(data) == 4


def test_non_streaming_request_waits_silently(sup: SupervisorProcess) -> None:
    lease = sup.client.post("/admin/leases", json={"model": None, "ttl_s": 60}).json()
    timer = threading.Timer(0.8, lambda: sup.client.delete(f"/admin/leases/{lease['id']}"))
    timer.start()
    resp = sup.client.post("/v1/completions", json={"model": "fake", "prompt": "x"})
    timer.join()
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["text"] == "fake"


def test_queued_stream_that_times_out_gets_an_sse_error_event(tmp_path: Path) -> None:
    proc = fake_supervisor(tmp_path, config=HARDENED_CONFIG + "[pool]\nqueue_timeout_s = 1\n")
    try:
        proc.client.post("/admin/leases", json={"model": None, "ttl_s": 60})
        with proc.client.stream("POST", "/v1/completions", json={"model": "fake", "stream": True}) as resp:
            assert resp.status_code == 200
            lines = list(resp.iter_lines())
        assert any(line.startswith(":") for line in lines)
        [event] = [line for line in lines if line.startswith("data: ")]
        assert json.loads(event[6:])["error"]["code"] == "queue_timeout"
    finally:
        proc.stop()


def test_queued_stream_whose_client_leaves_is_taken_out_of_the_queue(sup: SupervisorProcess) -> None:
    lease = sup.client.post("/admin/leases", json={"model": None, "ttl_s": 60}).json()
    try:
        body = json.dumps({"model": "fake", "stream": True}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{sup.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", sup.port)) as sock:
            sock.sendall(head + body)
            sock.settimeout(5)
            assert b": waiting" in sock.recv(4096) + sock.recv(4096)
        assert wait_for(lambda: sup.client.get("/admin/engines").json()["data"][0]["queued"] == 0, 5)
    finally:
        sup.client.delete(f"/admin/leases/{lease['id']}")
    assert "Traceback" not in sup.log()
    assert sup.client.post("/v1/completions", json={"model": "fake", "prompt": "x"}).status_code == 200


@pytest.mark.parametrize("path", ["/admin/load", "/admin/unload", "/admin/drain", "/admin/leases"])
def test_admin_routes_refuse_an_empty_model_name(sup: SupervisorProcess, path: str) -> None:
    resp = sup.client.post(path, json={"model": ""})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "model"
