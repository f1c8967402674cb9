"""A small HTTP client for the supervisor's admin API, on the stdlib only.

The admin commands (`mlxd ps`, `load`, `lease`, ...) must start fast: no aiohttp, no mlx, no
httpx here. Every failure is an `AdminError` whose text is the one line to show the user.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from mlxd import __version__

CONNECT_TIMEOUT_S = 5.0
KEY_VARS = ("MLXD_ADMIN_KEY", "MLXD_API_KEY")  # the first one set wins


class AdminError(Exception):
    """A failed admin call; `str()` is the message for the user."""


class Unreachable(AdminError):
    """Nothing answers at the daemon's address."""

    def __init__(self, url: str, reason: OSError) -> None:
        if isinstance(reason, ConnectionRefusedError | FileNotFoundError):
            text = f"mlxd is not running at {url} (start it with `mlxd start`)"
        else:
            text = f"cannot reach mlxd at {url}: {reason.strerror or reason}"
        super().__init__(text)
        self.url = url


class HTTPFailure(AdminError):
    """The daemon answered with an HTTP error; the fields of its OpenAI-format error body."""

    def __init__(self, status: int, message: str, *, type: str | None = None, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param


def error_from_response(status: int, reason: str, body: bytes) -> HTTPFailure:
    """An `HTTPFailure` from an error response: the OpenAI error body when there is one."""
    try:
        detail = json.loads(body)["error"]
        return HTTPFailure(status, str(detail["message"]), type=detail.get("type"), code=detail.get("code"),
                           param=detail.get("param"))
    except (ValueError, KeyError, TypeError):
        text = body.decode(errors="replace").strip().splitlines()
        return HTTPFailure(status, f"HTTP {status} {reason}" + (f": {text[0][:200]}" if text else ""))


def normalize_url(url: str) -> str:
    """`host:port` or `http://host:port/prefix/` as `http://host:port/prefix`; ValueError if unusable."""
    url = url.strip()
    if "://" not in url:
        url = f"http://{url}"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http:// URL: {url!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ValueError(f"bad port in URL: {url!r}") from None
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def resolve_key(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The key to send and the variable it came from: $MLXD_ADMIN_KEY, else $MLXD_API_KEY."""
    for name in KEY_VARS:
        if value := env.get(name, "").strip():
            return value, name
    return None, None


class AdminClient:
    """JSON requests to one mlxd; one connection per request (the CLI makes a handful)."""

    def __init__(self, url: str, key: str | None = None, key_source: str | None = None) -> None:
        self.url = url
        self.key = key
        self.key_source = key_source
        parts = urlsplit(url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")

    def get(self, path: str, *, timeout: float | None = 30.0) -> Any:
        """GET `path`, decoded JSON."""
        return self.request("GET", path, None, timeout=timeout)

    def post(self, path: str, body: Mapping[str, Any] | None = None, *, timeout: float | None = 30.0) -> Any:
        """POST a JSON body to `path`, decoded JSON; `timeout=None` waits as long as it takes."""
        return self.request("POST", path, {} if body is None else body, timeout=timeout)

    def delete(self, path: str, *, timeout: float | None = 30.0) -> Any:
        """DELETE `path`, decoded JSON."""
        return self.request("DELETE", path, None, timeout=timeout)

    def request(self, method: str, path: str, body: Mapping[str, Any] | None, *, timeout: float | None) -> Any:
        """One request; an `AdminError` for anything but a 2xx JSON answer."""
        conn = self._connect()
        try:
            conn.sock.settimeout(timeout)
            payload = None if body is None else json.dumps(body).encode()
            conn.request(method, self._prefix + path, body=payload, headers=self._headers(payload))
            resp = conn.getresponse()
            data = resp.read()
        except TimeoutError:
            raise AdminError(f"mlxd at {self.url} did not answer {method} {path} in {timeout:.0f} s") from None
        except (http.client.HTTPException, OSError) as exc:
            raise AdminError(f"mlxd at {self.url} dropped the connection during {method} {path} "
                             f"({exc or type(exc).__name__}); did it stop?") from None
        finally:
            conn.close()
        if resp.status >= 400:
            raise error_from_response(resp.status, resp.reason, data)
        try:
            return json.loads(data)
        except ValueError:
            raise AdminError(f"{self.url}{path} answered {resp.status} with something that is not JSON; "
                             "is that an mlxd?") from None

    def events(self, path: str) -> Iterator[Any]:
        """GET an SSE stream at `path`: each event's `data`, decoded JSON, until it ends."""
        conn = self._connect()
        try:
            conn.sock.settimeout(None)
            conn.request("GET", self._prefix + path, headers=self._headers(None))
            resp = conn.getresponse()
            if resp.status >= 400:
                raise error_from_response(resp.status, resp.reason, resp.read())
            while line := resp.readline():
                if line.startswith(b"data: "):
                    yield json.loads(line[6:])
        except (http.client.HTTPException, OSError) as exc:
            raise AdminError(f"mlxd at {self.url} dropped the stream of {path} ({exc or type(exc).__name__}); "
                             "did it stop?") from None
        finally:
            conn.close()

    def _connect(self) -> http.client.HTTPConnection:
        """An open connection, or `Unreachable`."""
        conn: http.client.HTTPConnection
        if self._https:
            conn = http.client.HTTPSConnection(self._host, self._port, timeout=CONNECT_TIMEOUT_S)
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=CONNECT_TIMEOUT_S)
        try:
            conn.connect()
        except (OSError, socket.gaierror) as exc:
            conn.close()
            raise Unreachable(self.url, exc) from None
        return conn

    def _headers(self, payload: bytes | None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": f"mlxd-cli/{__version__}"}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        return headers
