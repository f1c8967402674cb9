"""Host and Origin checks: which names and browser pages may use mlxd."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxd.supervisor.http.guard import HostPolicy, check, needs_json, split_host

POLICY = HostPolicy.make("127.0.0.1", ["mlxd.lan", "*.example.org"], ["http://app.example.com", "http://localhost:*"],
                         machine_names=["studio", "studio.local"])


@pytest.mark.parametrize(("header", "name"), [
    ("localhost:8800", "localhost"), ("[::1]:8800", "::1"), ("[::1]", "::1"), ("Example.COM.", "example.com"),
    ("127.0.0.1", "127.0.0.1"), ("::1", "::1"),
])
def test_split_host(header: str, name: str) -> None:
    assert split_host(header) == name


@pytest.mark.parametrize("host", [
    "localhost:8800", "127.0.0.1:8800", "127.1.2.3", "[::1]:8800", "app.localhost:8800", "10.0.0.5:8800",
    "[fe80::1]:8800", "mlxd.lan", "a.example.org", "studio:8800", "studio.local", "LOCALHOST",
    "host.docker.internal:8800", "host.containers.internal",
])
def test_hosts_that_name_this_server(host: str) -> None:
    assert POLICY.is_allowed_host(host)


@pytest.mark.parametrize("host", [
    "evil.example", "evil.example:8800", "localhost.evil.example", "127.0.0.1.nip.io", "example.org",
    "mlxd.lan.evil.example", "", "studio.evil", "internal.evil.example", "other.local",
])
def test_foreign_hosts(host: str) -> None:
    assert not POLICY.is_allowed_host(host)


def test_missing_host_is_http10_and_allowed() -> None:
    assert POLICY.is_allowed_host(None)


def test_star_allows_every_host() -> None:
    assert HostPolicy.make("127.0.0.1", ["*"], []).is_allowed_host("anything.example")


def test_listen_address_is_a_name_of_the_server() -> None:
    assert HostPolicy.make("mybox.internal", [], []).is_allowed_host("mybox.internal:8800")


@pytest.mark.parametrize(("origin", "host", "ok"), [
    ("http://127.0.0.1:8800", "127.0.0.1:8800", True),  # its own page
    ("http://127.0.0.1:8801", "127.0.0.1:8800", False),  # another port is another origin
    ("http://app.example.com", "127.0.0.1:8800", True),
    ("http://APP.example.com/", "127.0.0.1:8800", True),
    ("https://app.example.com", "127.0.0.1:8800", False),
    ("http://localhost:5173", "127.0.0.1:8800", True),
    ("http://evil.example", "127.0.0.1:8800", False),
    ("null", "127.0.0.1:8800", False),
    ("chrome-extension://abc", "127.0.0.1:8800", False),
    ("http://evil.example", None, False),
])
def test_origins(origin: str, host: str | None, ok: bool) -> None:
    assert POLICY.is_allowed_origin(origin, host) is ok


def test_check_reasons() -> None:
    assert check(POLICY, {"Host": "127.0.0.1:8800"}) is None
    assert "DNS rebinding" in (check(POLICY, {"Host": "evil.example"}) or "")
    assert "cross-site" in (check(POLICY, {"Host": "127.0.0.1:8800", "Origin": "http://evil.example"}) or "")
    assert check(POLICY, {"Host": "127.0.0.1:8800", "Sec-Fetch-Site": "cross-site"}) is not None
    assert check(POLICY, {"Host": "127.0.0.1:8800", "Sec-Fetch-Site": "none"}) is None
    assert check(POLICY, {"Host": "127.0.0.1:8800", "Sec-Fetch-Site": "cross-site",
                          "Origin": "http://app.example.com"}) is None


@given(st.text(max_size=2000))
def test_refusal_messages_stay_short(host: str) -> None:
    reason = check(POLICY, {"Host": host})
    assert reason is None or len(reason) <= 300


@pytest.mark.parametrize(("method", "path", "ctype", "refused"), [
    ("POST", "/admin/unload", "text/plain", True),
    ("POST", "/admin/unload", "application/x-www-form-urlencoded", True),
    ("POST", "/admin/unload", "multipart/form-data; boundary=x", True),
    ("POST", "/admin/unload", "", True),
    ("POST", "/admin/unload", "application/json", False),
    ("POST", "/admin/unload", "Application/JSON; charset=utf-8", False),
    ("GET", "/admin/engines", "", False),
    ("POST", "/v1/chat/completions", "text/plain", False),  # curl -d sends a form type; Origin guards these
])
def test_admin_posts_need_json(method: str, path: str, ctype: str, refused: bool) -> None:
    headers = {"Content-Type": ctype} if ctype else {}
    assert needs_json(method, path, headers) is refused
