"""Requests a handler makes to this supervisor's own routes, as its caller (the Responses
socket's turns and compaction's summary run through the HTTP routes, so they are stored,
logged, metered and refused as the caller's own requests are).

The address is the one the caller's connection came in on (a wildcard bind is reached on its
loopback); the caller's credentials and Host go along, so auth and the Host check treat the
request as the caller's.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp import web

from mlxd.supervisor.http.keys import CONFIG

FORWARDED = ("Authorization", "x-api-key", "OpenAI-Organization", "OpenAI-Project")
TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10)


class Loopback:
    """An HTTP session to this supervisor on behalf of `request`'s caller (close it after)."""

    def __init__(self, request: web.Request) -> None:
        sock = request.transport.get_extra_info("sockname") if request.transport is not None else None
        host, port = (sock[0], sock[1]) if isinstance(sock, tuple) else ("127.0.0.1", request.app[CONFIG].server.port)
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        self.base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self.headers = {k: v for k in FORWARDED if (v := request.headers.get(k)) is not None}
        self.headers["Host"] = request.headers.get("Host", f"{host}:{port}")
        self.session = aiohttp.ClientSession(timeout=TIMEOUT, trust_env=False)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """`async with loopback.post(path, body) as resp:` the answer, as it comes."""
        return self.session.post(self.base + path, json=body, headers=self.headers)

    async def close(self) -> None:
        await self.session.close()


async def error_of(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    """The `error` object of an answer that is not a 200 (its status's name where it has none)."""
    try:
        err = (await resp.json(content_type=None)).get("error")
    except (ValueError, aiohttp.ClientError, AttributeError):
        err = None
    if not isinstance(err, dict):
        err = {}
    return {"type": err.get("type", "invalid_request_error"), "code": err.get("code"),
            "message": err.get("message", f"HTTP {resp.status}"), "param": err.get("param")}
