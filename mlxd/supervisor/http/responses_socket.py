"""The Responses API over a WebSocket (`GET /v1/responses` with an upgrade), OpenAI's
"WebSocket mode": one long-lived connection, a `response.create` message a turn (the body of
`POST /v1/responses`, without `stream`), the same events a stream sends coming back as JSON
text messages.

Each turn is the HTTP route's own work: the socket's handler posts the turn to this
supervisor's `/v1/responses` (streamed, over loopback to the address the socket came in on,
with the socket's credentials) and passes each event on. So a socket's turns are stored,
chained, logged, metered and refused exactly as POSTed ones are. Turns on one socket run one
after another, in the order they came.

- A turn with `store: false` is kept in the socket's memory: a later turn on the same socket
  may chain on it with `previous_response_id` (its input and output are sent as history),
  as OpenAI's socket allows; nothing of it outlives the socket.
- Anything that cannot be a turn (not JSON, another `type`, `background`) is answered with an
  `error` event, `{"type": "error", "status": 400, "error": {"type", "code", "message",
  "param"}}`, and the socket stays open. A refused turn (an unknown model, a bad field) is
  the same event with the HTTP route's status and error.
- A client that closes the socket mid-turn ends the turn: the loopback request is dropped, so
  the engine stops generating, as for a closed stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

from mlxd.protocol.errors import APIError
from mlxd.supervisor.http.keys import CONFIG
from mlxd.supervisor.http.loopback import Loopback, error_of

log = logging.getLogger("mlxd.supervisor")


def error_event(status: int, message: str, code: str | None = None, param: str | None = None,
                kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "status": status,
            "error": {"type": kind, "code": code, "message": message, "param": param}}


class Turns:
    """One socket's state: its HTTP session back to this supervisor and its unstored responses."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse) -> None:
        self._ws = ws
        self._loopback = Loopback(request)
        self._unstored: dict[str, list[dict[str, Any]]] = {}  # response id -> its chain's items, in order

    async def close(self) -> None:
        await self._loopback.close()

    async def take(self, text: str) -> None:
        """One message from the client."""
        try:
            event = json.loads(text)
        except ValueError:
            await self._send(error_event(400, "A message must be a JSON object.", "invalid_json"))
            return
        if not isinstance(event, dict) or event.get("type") != "response.create":
            kind = event.get("type") if isinstance(event, dict) else None
            await self._send(error_event(400, f"Unknown event type {kind!r}: this socket takes response.create.",
                                         "unknown_event_type", "type"))
            return
        body = {k: v for k, v in event.items() if k not in ("type", "stream")}
        if body.get("background"):
            await self._send(error_event(400, "background is not supported over a WebSocket.",
                                         "unsupported_parameter", "background"))
            return
        body.pop("background", None)
        self._chain_unstored(body)
        await self._run({**body, "stream": True}, store=body.get("store", True) is not False)

    def _chain_unstored(self, body: dict[str, Any]) -> None:
        """A turn chained on an unstored response of this socket: that chain's items go first."""
        previous = body.get("previous_response_id")
        if not isinstance(previous, str) or previous not in self._unstored:
            return
        given = body.get("input", [])
        if isinstance(given, str):
            given = [{"type": "message", "role": "user", "content": given}]
        body["input"] = [*self._unstored[previous], *(given if isinstance(given, list) else [given])]
        del body["previous_response_id"]
        body["_socket_input"] = given  # this turn's own input, for its entry in the socket's memory

    async def _run(self, body: dict[str, Any], store: bool) -> None:
        own_input = body.pop("_socket_input", None)
        try:
            async with self._loopback.post("/v1/responses", body) as resp:
                if resp.status != 200:
                    await self._send({"type": "error", "status": resp.status, "error": await error_of(resp)})
                    return
                async for data in sse_data(resp):
                    if data == "[DONE]":
                        continue
                    if self._ws.closed:
                        return  # the client left: leaving the block drops the request, and the engine stops
                    await self._ws.send_str(data)
                    if not store:
                        self._remember(data, body, own_input)
        except aiohttp.ClientError as exc:
            log.warning("responses socket: a turn failed on loopback: %s", exc)
            await self._send(error_event(502, f"The turn could not be run: {exc}.", "loopback_failed",
                                         kind="server_error"))

    def _remember(self, data: str, body: dict[str, Any], own_input: Any) -> None:
        """Keep an unstored response's chain (its input and output items) once it ended."""
        head = data[:64]
        if '"response.completed"' not in head and '"response.incomplete"' not in head:
            return
        response = json.loads(data).get("response") or {}
        given = body.get("input", []) if own_input is None else own_input
        if isinstance(given, str):
            given = [{"type": "message", "role": "user", "content": given}]
        earlier = body["input"][:len(body["input"]) - len(given)] if own_input is not None else []
        if isinstance(response.get("id"), str):
            self._unstored[response["id"]] = [*earlier, *given, *(response.get("output") or [])]

    async def refuse(self, event: dict[str, Any]) -> None:
        await self._send(event)

    async def _send(self, event: dict[str, Any]) -> None:
        if not self._ws.closed:
            await self._ws.send_str(json.dumps(event))


async def sse_data(resp: aiohttp.ClientResponse) -> Any:
    """The `data` of each SSE event of a streamed answer, as text (comments skipped)."""
    pending: list[str] = []
    async for raw in resp.content:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("data:"):
            pending.append(line[5:].lstrip(" "))
        elif not line and pending:
            yield "\n".join(pending)
            pending = []
    if pending:
        yield "\n".join(pending)


async def socket(request: web.Request) -> web.StreamResponse:
    """GET /v1/responses: the WebSocket (a plain GET is a 405 pointing at POST and the upgrade)."""
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=request.app[CONFIG].server.max_body_bytes)
    if not ws.can_prepare(request).ok:
        raise APIError(405, "Use POST /v1/responses, or open a WebSocket here (a GET with Upgrade: websocket).",
                       code="method_not_allowed", headers={"Allow": "GET, POST"})
    await ws.prepare(request)
    turns = Turns(request, ws)
    # The socket is read while a turn runs, so a close (or a lost connection) is seen at once and
    # ends the turn; the messages that come meanwhile wait their turn, in order.
    inbox: asyncio.Queue[str | None] = asyncio.Queue()
    worker = asyncio.create_task(work(turns, inbox))
    try:
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                inbox.put_nowait(msg.data)
            elif msg.type == aiohttp.WSMsgType.BINARY:
                inbox.put_nowait(None)
    finally:
        worker.cancel()  # a turn still running: leaving its request drops it, and the engine stops
        with contextlib.suppress(asyncio.CancelledError):
            await worker
        await turns.close()
    return ws


async def work(turns: Turns, inbox: asyncio.Queue[str | None]) -> None:
    """A socket's turns, one after another (None: a binary message, refused)."""
    while True:
        text = await inbox.get()
        if text is None:
            await turns.refuse(error_event(400, "Messages are JSON text, not binary.", "invalid_message"))
        else:
            await turns.take(text)
