"""proxy.call, the supervisor's client for an engine's health, stats and drain: a whole
answer, whatever way its body is framed; an answer cut short, one that is not HTTP, and no
listener are errors the callers catch."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from mlxd.supervisor.engines.upstream import UpstreamError, call

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def answered_by(path: Path, serve: Serve, method: str = "GET", body: bytes = b"") -> tuple[int, bytes]:
    async def go() -> tuple[int, bytes]:
        server = await asyncio.start_unix_server(serve, str(path))
        async with server:
            return await call(path, method, "/health", body, timeout_s=2)

    return asyncio.run(go())


def replying(raw: bytes, seen: list[bytes] | None = None) -> Serve:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if seen is not None:
            seen.append(head)
        writer.write(raw)
        await writer.drain()
        writer.close()

    return serve


@pytest.mark.parametrize("raw", [
    b'HTTP/1.1 200 OK\r\nContent-Length: 18\r\n\r\n{"status":"ready"}',
    b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n8\r\n{"status\r\n9\r\n":"ready"\r\n1\r\n}\r\n0\r\n\r\n',
    b'HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{"status":"ready"}',  # the body runs to the close
])
def test_a_whole_answer_however_framed(tmp_path: Path, raw: bytes) -> None:
    seen: list[bytes] = []
    status, body = answered_by(tmp_path / "e.sock", replying(raw, seen))
    assert status == 200 and body == b'{"status":"ready"}'
    assert seen[0].startswith(b"GET /health HTTP/1.1\r\n")


def test_an_answer_cut_short_is_an_upstream_error(tmp_path: Path) -> None:
    with pytest.raises(UpstreamError):
        answered_by(tmp_path / "e.sock", replying(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{\"st"))


def test_an_answer_that_is_not_http_is_an_upstream_error(tmp_path: Path) -> None:
    with pytest.raises(UpstreamError):
        answered_by(tmp_path / "e.sock", replying(b"SSH-2.0-OpenSSH\r\n\r\n"))


def test_nothing_listening_is_an_os_error(tmp_path: Path) -> None:
    path = tmp_path / "e.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
    with pytest.raises(OSError):
        asyncio.run(call(path, "GET", "/health"))


def test_an_engine_that_never_answers_times_out(tmp_path: Path) -> None:
    # Both ends close before the loop does: a socket left to the garbage collector after
    # asyncio.run raised an unraisable ResourceWarning now and then (filterwarnings = error).
    async def go() -> None:
        gone = asyncio.Event()

        async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()  # says nothing; the read ends when the client gives up and closes
            writer.close()
            await writer.wait_closed()
            gone.set()

        server = await asyncio.start_unix_server(mute, str(tmp_path / "e.sock"))
        async with server:
            try:
                await call(tmp_path / "e.sock", "GET", "/health", timeout_s=0.2)
            finally:
                await asyncio.wait_for(gone.wait(), 5)

    with pytest.raises(TimeoutError):
        asyncio.run(go())
