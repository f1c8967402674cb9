"""A dead engine's socket: refused, or a connection dropped with no answer, is `EngineUnreachable`."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request

from mlxd.protocol.errors import APIError
from mlxd.supervisor.engines.upstream import EngineUnreachable, connection_gate
from mlxd.supervisor.relay.dialects import OPENAI
from mlxd.supervisor.relay.forward import forward
from tests.support import wait_for_async


def run_forward(path: Path) -> None:
    async def go() -> None:
        request = make_mocked_request("POST", "/v1/completions")
        await forward(request, path, connection_gate(), b"{}", {}, OPENAI)

    asyncio.run(go())


def test_nothing_listening_is_unreachable_and_nothing_was_sent(tmp_path: Path) -> None:
    path = tmp_path / "e.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))  # a socket file left by a killed engine: nobody listens
    with pytest.raises(EngineUnreachable) as info:
        run_forward(path)
    assert info.value.was_sent is False


def test_a_connection_dropped_at_once_is_unreachable_but_sent(tmp_path: Path) -> None:
    path = tmp_path / "e.sock"

    async def go() -> None:
        async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()  # a dying engine: the connection lands, and is closed unread

        server = await asyncio.start_unix_server(drop, str(path))
        async with server:
            request = make_mocked_request("POST", "/v1/completions")
            await forward(request, path, connection_gate(), b"{}", {}, OPENAI)

    with pytest.raises(EngineUnreachable) as info:
        asyncio.run(go())
    assert info.value.was_sent is True


def test_a_connection_lost_after_a_while_is_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "e.sock"

    async def go() -> None:
        async def slow_death(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(10)
            await asyncio.sleep(0.3)  # it was working on the request when it died
            writer.close()

        server = await asyncio.start_unix_server(slow_death, str(path))
        async with server:
            request = make_mocked_request("POST", "/v1/completions")
            await forward(request, path, connection_gate(), b"{}", {}, OPENAI)

    with pytest.raises(APIError) as info:
        asyncio.run(go())
    assert info.value.code == "engine_crashed"


def test_a_connection_lost_before_the_request_is_written_is_unreachable_and_nothing_was_sent(tmp_path: Path) -> None:
    """Under uvloop (as mlxd serves), writing to a transport already closed raises RuntimeError:
    an engine killed between our connect and our write once gave the caller a 500."""
    uvloop = pytest.importorskip("uvloop", reason="uvloop is what mlxd serves with; the race is uvloop's")
    path = tmp_path / "e.sock"

    async def go() -> None:
        async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        loop = asyncio.get_running_loop()
        connect = loop.create_unix_connection

        async def connect_then_lose(factory: Any, sock_path: str) -> Any:
            transport, proto = await connect(factory, sock_path)
            assert await wait_for_async(lambda: proto.lost)  # the engine's close arrives before we write
            return transport, proto

        setattr(loop, "create_unix_connection", connect_then_lose)  # noqa: B010 (a method of the loop object)
        server = await asyncio.start_unix_server(drop, str(path))
        async with server:
            request = make_mocked_request("POST", "/v1/completions")
            await forward(request, path, connection_gate(), b"{}", {}, OPENAI)

    with pytest.raises(EngineUnreachable) as info:
        uvloop.run(go())
    assert info.value.was_sent is False
