"""Connection caps, parse-error causes and the rate-limited log: pure parts of connections.py."""

from __future__ import annotations

import json
import logging

import pytest
from aiohttp import http_exceptions

from mlxd.protocol.errors import APIError
from mlxd.supervisor.http.connections import (
    Admit,
    ConnView,
    RateLimitedLog,
    Refuse,
    admit_connection,
    cause_of,
    raw_response,
)


def conns(*specs: tuple[str, bool]) -> list[ConnView]:
    return [ConnView(i, peer, float(i), idle) for i, (peer, idle) in enumerate(specs)]


def test_room_left_admits() -> None:
    assert admit_connection(conns(("a", False)), "a", max_total=2, max_per_peer=2) == Admit()


def test_at_the_total_cap_the_oldest_idle_connection_makes_room() -> None:
    open_ = conns(("a", False), ("b", True), ("c", True))
    assert admit_connection(open_, "d", max_total=3, max_per_peer=3) == Admit(evict=1)


def test_per_peer_cap_evicts_only_that_peers_idle_connections() -> None:
    open_ = conns(("x", True), ("a", False), ("a", True))
    assert admit_connection(open_, "a", max_total=10, max_per_peer=2) == Admit(evict=2)


def test_all_busy_refuses() -> None:
    decision = admit_connection(conns(("a", False), ("b", False)), "c", max_total=2, max_per_peer=5)
    assert isinstance(decision, Refuse)
    assert "2 connections" in decision.reason


@pytest.mark.parametrize(("exc", "cause"), [
    (http_exceptions.BadHttpMethod("HELLO"), "bad method"),
    (http_exceptions.LineTooLong("x" * 10, "8190"), "request line or header too long"),
    (http_exceptions.BadStatusLine("GET / HTTP/9"), "bad request line"),
    (http_exceptions.InvalidHeader("\x00"), "bad header"),
    (http_exceptions.BadHttpMessage("secret input"), "malformed message"),
    (ValueError("secret input"), "malformed HTTP request"),
])
def test_causes_never_carry_the_input(exc: Exception, cause: str) -> None:
    assert cause_of(exc, 400) == cause


def test_raw_response_is_complete_http_with_json() -> None:
    answer = raw_response(503, APIError(503, "busy", code="too_many_connections", headers={"Retry-After": "1"}))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"Connection: close" in head and b"Retry-After: 1" in head
    assert f"Content-Length: {len(body)}".encode() in head
    assert json.loads(body)["error"]["code"] == "too_many_connections"


def test_rate_limited_log_one_line_per_cause_per_period(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limited = RateLimitedLog(every_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "mlxd.supervisor"):
        assert limited.warning("bad method", "from a")
        assert not limited.warning("bad method", "from b")
        assert not limited.warning("bad method", "from c")
        assert limited.warning("bad header", "from a")
        now[0] = 61
        assert limited.warning("bad method", "from d")
    assert [r.getMessage() for r in caplog.records] == [
        "bad method: from a", "bad header: from a", "bad method: from d (and 2 more since the last report)",
    ]
