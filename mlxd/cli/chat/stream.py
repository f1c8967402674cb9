"""`mlxd run`'s side of the wire: a streamed chat completion over the stdlib's http.client.

`mlxd run` must start fast, so no aiohttp or httpx; the chunks decode into msgspec Structs
(unknown fields ignored). Closing the connection mid-stream is how an answer is stopped:
the daemon cancels the generation at its next decode step (docs/api.md, Streaming).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import msgspec

from mlxd import __version__
from mlxd.cli.admin.client import AdminError, Unreachable, error_from_response

CONNECT_TIMEOUT_S = 5.0


class ToolCallFunction(msgspec.Struct):
    """A streamed tool call's function: the name comes once, the arguments in pieces."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct):
    """One piece of a streamed tool call, by `index`."""

    index: int = 0
    function: ToolCallFunction | None = None


class Delta(msgspec.Struct):
    """What a chunk adds to the answer."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(msgspec.Struct):
    """A choice of a chunk (mlxd run asks for one)."""

    delta: Delta = msgspec.field(default_factory=Delta)
    index: int = 0
    finish_reason: str | None = None


class Usage(msgspec.Struct):
    """The last chunk's token counts (`stream_options.include_usage`)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


class StreamError(msgspec.Struct):
    """An error sent inside a stream that had already started."""

    message: str = "the stream failed"
    code: str | None = None


class Chunk(msgspec.Struct):
    """One `data: {...}` event of a chat stream."""

    choices: list[ChunkChoice] = msgspec.field(default_factory=list)
    usage: Usage | None = None
    error: StreamError | None = None


class StreamFailure(AdminError):
    """The stream broke: an error event, a dropped connection, or something that is not SSE."""


_chunk_decoder = msgspec.json.Decoder(Chunk)
DONE = "[DONE]"


def parse_sse_line(line: bytes) -> Chunk | str | None:
    """A chunk for a `data: {json}` line, DONE for `data: [DONE]`, None for anything else.

    Comments (`: keep-alive`), blank lines and other fields carry nothing for us.
    """
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return DONE
    try:
        return _chunk_decoder.decode(payload)
    except msgspec.DecodeError:
        raise StreamFailure(f"mlxd sent an event that is not a chat chunk: {payload[:120]!r}") from None


def chat_body(model: str, messages: list[dict[str, str]], params: Mapping[str, Any]) -> dict[str, Any]:
    """The POST /v1/chat/completions body: streamed, usage at the end, the set parameters."""
    return {"model": model, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
            **{k: v for k, v in params.items() if v is not None}}


class ChatStream:
    """One streamed chat completion; iterate for its chunks, `close()` to stop it early."""

    def __init__(self, url: str, key: str | None) -> None:
        self.url = url
        self.key = key
        parts = urlsplit(url)
        conn_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._conn = conn_type(parts.hostname or "127.0.0.1", parts.port, timeout=CONNECT_TIMEOUT_S)
        self._path = parts.path.rstrip("/") + "/v1/chat/completions"
        self._resp: http.client.HTTPResponse | None = None

    def open(self, body: Mapping[str, Any]) -> ChatStream:
        """Send the request and read the answer's head; an AdminError for a refusal."""
        try:
            self._conn.connect()
        except OSError as exc:
            self.close()
            raise Unreachable(self.url, exc) from None
        payload = json.dumps(body).encode()
        try:
            self._conn.sock.settimeout(None)  # a cold model may take minutes; keep-alives come meanwhile
            self._conn.request("POST", self._path, body=payload, headers=self._headers())
            self._resp = self._conn.getresponse()
        except (http.client.HTTPException, OSError) as exc:
            self.close()
            raise StreamFailure(f"mlxd at {self.url} dropped the connection ({exc or type(exc).__name__})") from None
        if self._resp.status >= 400:
            data = self._resp.read()
            self.close()
            raise error_from_response(self._resp.status, self._resp.reason, data)
        return self

    def __iter__(self) -> Iterator[Chunk]:
        """The chunks until `[DONE]`; a StreamFailure for an error event or a stream cut short."""
        assert self._resp is not None, "open() first"
        while True:
            try:
                line = self._resp.readline()
            except (http.client.HTTPException, OSError) as exc:
                raise StreamFailure(f"mlxd dropped the stream ({exc or type(exc).__name__})") from None
            if not line:
                raise StreamFailure("mlxd ended the stream before it was done")
            event = parse_sse_line(line)
            if event == DONE:
                return
            if isinstance(event, Chunk):
                if event.error is not None:
                    raise StreamFailure(event.error.message)
                yield event

    def close(self) -> None:
        """Drop the connection: mid-stream, the daemon cancels the generation."""
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):  # the response holds a file on it: close() alone leaves it open
                sock.shutdown(socket.SHUT_RDWR)
        self._conn.close()
        if self._resp is not None:
            self._resp.close()

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream",
                   "User-Agent": f"mlxd-cli/{__version__}"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        return headers
