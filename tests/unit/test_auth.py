"""API keys and the loopback-only rule for serving without keys."""

from __future__ import annotations

import pytest

from mlxd.supervisor.config import ConfigError
from mlxd.supervisor.http.auth import Auth, check_bind, is_loopback, presented_keys


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_no_keys_allows_everything() -> None:
    auth = Auth([], [])
    assert auth.check({}, admin=False) and auth.check({}, admin=True)
    assert auth.check(bearer("anything"), admin=True)
    assert not auth.needs_key(admin=False) and not auth.needs_key(admin=True)


def test_bearer_and_x_api_key() -> None:
    auth = Auth(["sk-1", "sk-2"])
    assert auth.check(bearer("sk-1"), admin=False)
    assert auth.check({"x-api-key": "sk-2"}, admin=False)
    assert auth.check({"authorization": "bearer sk-2"}, admin=False)
    assert auth.check({"X-Api-Key": "sk-1"}, admin=False)
    assert not auth.check(bearer("sk-3"), admin=False)
    assert not auth.check({}, admin=False)
    assert not auth.check({"Authorization": "Basic sk-1"}, admin=False)
    assert not auth.check({"Authorization": "sk-1"}, admin=False)
    assert not auth.check(bearer("sk-"), admin=False)
    assert not auth.check(bearer("sk-11"), admin=False)
    assert auth.needs_key(admin=False)


def test_either_header_may_carry_the_key() -> None:
    auth = Auth(["good"])
    assert auth.check({"Authorization": "Bearer wrong", "x-api-key": "good"}, admin=False)
    assert presented_keys({"Authorization": "Bearer  a ", "x-api-key": " b"}) == ["a", "b"]
    assert presented_keys({"Authorization": "Bearer ", "x-api-key": ""}) == []


def test_api_keys_administer_when_no_admin_keys() -> None:
    auth = Auth(["sk"])
    assert auth.check(bearer("sk"), admin=True)
    assert not auth.check(bearer("other"), admin=True)


def test_admin_keys_are_separate() -> None:
    auth = Auth(["sk"], ["adm"])
    assert not auth.check(bearer("sk"), admin=True)
    assert auth.check(bearer("adm"), admin=True)
    assert auth.check(bearer("adm"), admin=False)  # an admin key also works for inference
    assert auth.check(bearer("sk"), admin=False)


def test_admin_keys_alone_close_inference_too() -> None:
    auth = Auth([], ["adm"])
    assert not auth.check({}, admin=False) and not auth.check({}, admin=True)
    assert auth.check(bearer("adm"), admin=False) and auth.check(bearer("adm"), admin=True)
    assert auth.needs_key(admin=True) and auth.needs_key(admin=False)


def test_non_ascii_key() -> None:
    auth = Auth(["clé-ü"])
    assert auth.check(bearer("clé-ü"), admin=False)
    assert not auth.check(bearer("cle-u"), admin=False)


def test_aiohttp_headers() -> None:
    from multidict import CIMultiDict, CIMultiDictProxy

    headers = CIMultiDictProxy(CIMultiDict({"AUTHORIZATION": "Bearer k"}))
    assert Auth(["k"]).check(headers, admin=False)


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "127.1.2.3",
        "::1",
        "[::1]",
        "localhost",
        "LOCALHOST",
        "localhost.",
        "::ffff:127.0.0.1",
    ],
)
def test_loopback(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host", ["0.0.0.0", "::", "", "192.168.1.2", "10.0.0.1", "example.com", "128.0.0.1", "fe80::1"]
)
def test_not_loopback(host: str) -> None:
    assert not is_loopback(host)


def test_check_bind() -> None:
    check_bind("127.0.0.1", has_keys=False, insecure_no_auth=False)
    check_bind("0.0.0.0", has_keys=True, insecure_no_auth=False)
    check_bind("0.0.0.0", has_keys=False, insecure_no_auth=True)
    with pytest.raises(ConfigError, match=r"0\.0\.0\.0 without API keys.*--insecure-no-auth"):
        check_bind("0.0.0.0", has_keys=False, insecure_no_auth=False)


def test_a_keys_default_priority() -> None:
    auth = Auth(["person", "agent"], priorities={"agent": 10, "batch-job": -5})
    assert auth.default_priority({"Authorization": "Bearer agent"}) == 10
    assert auth.default_priority({"x-api-key": "batch-job"}) == -5
    assert auth.default_priority({"Authorization": "Bearer person"}) is None
    assert auth.default_priority({}) is None
    assert Auth(["person"]).default_priority({"Authorization": "Bearer person"}) is None
