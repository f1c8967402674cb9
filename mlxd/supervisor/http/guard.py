"""Who may reach mlxd from a browser: Host and Origin checks, CORS, and JSON-only admin posts.

mlxd listens on localhost, and every web page its user opens can send requests there. Two
attacks follow, and each check here stops one:
- DNS rebinding: a page on `evil.example` re-points that name at 127.0.0.1 and then reads
  mlxd's answers as same-origin. The browser still sends `Host: evil.example`: only hosts
  that name this machine are served (loopback names, IP literals, the listen address, the
  machine's own name, `*.internal` as containers name their host, and `server.allowed_hosts`).
- Cross-site requests: a page posts to http://127.0.0.1:8800 directly. The browser sends
  its `Origin` (and `Sec-Fetch-Site`); only mlxd's own origin and `server.allowed_origins`
  are served, and only those get CORS headers. A "simple" request (a form post with
  `text/plain`) needs no preflight, so admin posts must also say `application/json`.
Programs that are not browsers send neither `Origin` nor `Sec-Fetch-Site`, and pass.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Middleware

from mlxd.http_errors import Handler
from mlxd.protocol.errors import APIError
from mlxd.protocol.process import LEASE_HEADER
from mlxd.supervisor.http.auth import is_loopback
from mlxd.supervisor.relay.dialects import ANTHROPIC, OPENAI

ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
# Headers a browser client of mlxd's APIs sends: the keys, each API's SDK's own (its dialect
# names them), and mlxd's lease header.
ALLOW_HEADERS = ", ".join(("Authorization", "Content-Type", "X-API-Key", *ANTHROPIC.request_headers,
                           *OPENAI.request_headers, LEASE_HEADER))
EXPOSE_HEADERS = "Retry-After, X-Request-Id"
PREFLIGHT_MAX_AGE_S = "600"
CROSS_SITE = ("cross-site", "same-site")  # Sec-Fetch-Site values for another site's page
# Names no public DNS can serve (so no rebinding): `.internal` is reserved for private use;
# containers reach their host as `host.docker.internal` / `host.containers.internal`.
PRIVATE_SUFFIXES = (".internal",)
CORS_ORIGIN = "mlxd.cors_origin"  # request key: the allowed browser origin the answer is for


def split_host(value: str) -> str:
    """The name in a Host header (`[::1]:8800` -> `::1`), lower-cased, without a trailing dot."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def is_ip_literal(name: str) -> bool:
    """Whether `name` is an IPv4 or IPv6 address (a browser sends those as typed: no rebinding)."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class HostPolicy:
    """Which Host headers and browser Origins mlxd serves."""

    names: frozenset[str]  # exact host names, besides loopback names and IP literals
    patterns: tuple[str, ...]  # allowed_hosts entries with wildcards, e.g. `*.example.com`
    origins: tuple[str, ...]  # allowed_origins entries (fnmatch patterns; `*` allows every origin)
    any_host: bool = False  # allowed_hosts holds "*": no Host check

    @classmethod
    def make(cls, listen_host: str, allowed_hosts: Iterable[str], allowed_origins: Iterable[str],
             machine_names: Iterable[str] = ()) -> HostPolicy:
        """The policy for a server listening on `listen_host`, with the config's allow-lists."""
        hosts = [h.strip().lower().rstrip(".") for h in allowed_hosts]
        names = {split_host(listen_host), *(n.lower() for n in machine_names)} | {h for h in hosts if "*" not in h}
        names.discard("")
        patterns = tuple(h for h in hosts if "*" in h and h != "*")
        origins = tuple(o.strip().lower().rstrip("/") for o in allowed_origins)
        return cls(frozenset(names), patterns, origins, any_host="*" in hosts)

    def is_allowed_host(self, host_header: str | None) -> bool:
        """Whether a request's Host names this server (a missing Host is HTTP/1.0: allowed)."""
        if host_header is None or self.any_host:
            return True
        name = split_host(host_header)
        if is_loopback(name) or is_ip_literal(name) or name in self.names or name.endswith(PRIVATE_SUFFIXES):
            return True
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def is_allowed_origin(self, origin: str, host_header: str | None) -> bool:
        """Whether a browser page at `origin` may use mlxd: its own origin, or an allowed one."""
        origin = origin.strip().lower().rstrip("/")
        if any(fnmatch.fnmatchcase(origin, p) for p in self.origins):
            return True
        if origin == "null" or host_header is None:
            return False
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.netloc == host_header.strip().lower()


def machine_names() -> list[str]:
    """This machine's own host names (`studio`, `studio.local`), which a LAN client may use."""
    name = socket.gethostname().lower().rstrip(".")
    if not name:
        return []
    short = name.partition(".")[0]
    return sorted({name, short, f"{short}.local"})


def check(policy: HostPolicy, headers: Mapping[str, str]) -> str | None:
    """Why a request is refused (a message for the 403), or None to serve it."""
    host = headers.get("Host")
    if not policy.is_allowed_host(host):
        return (f"Host {host!r} is not a name of this server (DNS rebinding protection); "
                "add it to server.allowed_hosts to serve it.")[:300]
    origin = headers.get("Origin")
    if origin is not None:
        if not policy.is_allowed_origin(origin, host):
            return (f"Origin {origin!r} may not use this server (cross-site protection); "
                    "add it to server.allowed_origins to allow it.")[:300]
    elif headers.get("Sec-Fetch-Site", "").lower() in CROSS_SITE:
        return "Requests from another site's page are not served (cross-site protection)."
    return None


def needs_json(method: str, path: str, headers: Mapping[str, str]) -> bool:
    """Admin posts must say `application/json`: a cross-site form cannot, without a preflight."""
    if method != "POST" or not path.startswith("/admin/"):
        return False
    kind = headers.get("Content-Type", "").partition(";")[0].strip().lower()
    return kind != "application/json"


def cors_headers(origin: str, request_headers: str | None = None) -> dict[str, str]:
    """CORS response headers for an allowed `origin` (preflight ones when `request_headers` given)."""
    out = {"Access-Control-Allow-Origin": origin, "Vary": "Origin", "Access-Control-Expose-Headers": EXPOSE_HEADERS}
    if request_headers is not None:
        out["Access-Control-Allow-Methods"] = ALLOW_METHODS
        out["Access-Control-Allow-Headers"] = ALLOW_HEADERS
        out["Access-Control-Max-Age"] = PREFLIGHT_MAX_AGE_S
    return out


def make_guard_middleware(policy: HostPolicy) -> Middleware:
    """The middleware: 403 for foreign hosts and origins, preflights answered, CORS headers added."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if reason := check(policy, request.headers):
            raise APIError(403, reason, type="permission_error", code="forbidden_origin")
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and origin is not None and "Access-Control-Request-Method" in request.headers:
            headers = cors_headers(origin, request.headers.get("Access-Control-Request-Headers", ""))
            return web.Response(status=204, headers=headers)
        if needs_json(request.method, request.path, request.headers):
            raise APIError(415, "Admin requests must send `Content-Type: application/json`.",
                           code="unsupported_media_type")
        if origin is not None:
            request[CORS_ORIGIN] = origin
        return await handler(request)

    return guard


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every answer to an allowed browser origin (errors too) carries CORS."""
    origin = request.get(CORS_ORIGIN)
    if origin is not None and "Access-Control-Allow-Origin" not in response.headers:
        response.headers.update(cors_headers(origin))
