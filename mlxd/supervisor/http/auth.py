"""API keys: who may call the inference and admin routes, and where mlxd may listen without keys."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable, Mapping

from mlxd.supervisor.config import ConfigError


class Auth:
    """Checks the key a request presents, in constant time, against the configured keys."""

    def __init__(self, api_keys: Iterable[str], admin_keys: Iterable[str] = (),
                 priorities: Mapping[str, int] | None = None) -> None:
        self._priorities = [(_digest(k), p) for k, p in (priorities or {}).items()]
        api = [_digest(k) for k in api_keys]
        admin = [_digest(k) for k in admin_keys]
        # Any configured key closes the inference routes (so check_bind's has_keys means one
        # thing); an admin key also works for inference; with no admin keys, api keys administer.
        self._inference = api + admin
        self._admin = admin or api

    def needs_key(self, *, admin: bool) -> bool:
        """Whether a request must present a key at all (False: no keys configured)."""
        return bool(self._admin if admin else self._inference)

    def check(self, headers: Mapping[str, str], *, admin: bool) -> bool:
        """Whether the request's `Authorization: Bearer K` or `x-api-key: K` is accepted."""
        allowed = self._admin if admin else self._inference
        if not allowed:
            return True
        matched = False
        for presented in presented_keys(headers):
            candidate = _digest(presented)
            for key in allowed:
                # Equal-length digests and no early exit: timing says nothing about any key.
                matched |= hmac.compare_digest(candidate, key)
        return matched


    def default_priority(self, headers: Mapping[str, str]) -> int | None:
        """The `[server] key_priorities` entry of the key the request presents (None: none)."""
        found = None
        for presented in presented_keys(headers):
            candidate = _digest(presented)
            for key, priority in self._priorities:
                if hmac.compare_digest(candidate, key):
                    found = priority
        return found


def presented_keys(headers: Mapping[str, str]) -> list[str]:
    """The keys a request carries: the Bearer token and the x-api-key value, when present."""
    keys = []
    scheme, _, token = (_header(headers, "authorization") or "").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    if api_key := (_header(headers, "x-api-key") or "").strip():
        keys.append(api_key)
    return keys


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address: 127.0.0.0/8, ::1 or `localhost`."""
    name = host.strip().strip("[]").rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def check_bind(host: str, has_keys: bool, insecure_no_auth: bool) -> None:
    """Refuse to listen beyond loopback with no API keys, unless --insecure-no-auth says so."""
    if has_keys or insecure_no_auth or is_loopback(host):
        return
    raise ConfigError(
        f"refusing to listen on {host} without API keys: anyone who can reach this address "
        "could use the models. Set server.api_keys in the config file or MLXD_API_KEY, bind "
        "to 127.0.0.1, or pass --insecure-no-auth to serve without keys anyway."
    )


def _header(headers: Mapping[str, str], name: str) -> str | None:
    """A header by case-insensitive name, for plain dicts as well as aiohttp's CIMultiDict."""
    value = headers.get(name)
    if value is not None:
        return value
    return next((v for k, v in headers.items() if k.lower() == name), None)


def _digest(key: str) -> bytes:
    """SHA-256 of a key, so that every comparison is between equal-length values."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
