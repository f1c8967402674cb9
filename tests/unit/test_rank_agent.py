"""`mlxd rank`'s agent and what it says (protocol/rank_agent.py), in-process: the key's checks,
the handshake both ways, and the keepalive that ends a connection to a vanished host."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from mlxd.agent import rank as agent_mod
from mlxd.agent.rank import Agent
from mlxd.protocol import rank_agent as ra
from mlxd.supervisor.engines.ranks import Agent as Client

KEY = b"0123456789abcdef0123456789abcdef"


def test_the_key_file_must_be_private_and_long_enough(tmp_path: Path) -> None:
    path = tmp_path / "rank.key"
    path.write_text("short\n")
    path.chmod(0o600)
    with pytest.raises(ValueError, match="no key of at least 16 bytes"):
        ra.read_key(path)
    path.write_text(KEY.decode() + "\n")
    assert ra.read_key(path) == KEY
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        ra.read_key(path)


def test_hosts_entries_and_proofs() -> None:
    assert ra.split_host("10.0.0.2") == ("10.0.0.2", ra.DEFAULT_PORT)
    assert ra.split_host("10.0.0.2:9000") == ("10.0.0.2", 9000)
    challenge = ra.nonce()
    # a proof is bound to its role: an agent's answer cannot be replayed as a supervisor's
    assert ra.mac(KEY, b"agent", challenge) != ra.mac(KEY, b"supervisor", challenge)
    assert ra.mac(KEY, b"agent", challenge) != ra.mac(b"another key of sixteen+", b"agent", challenge)


def test_keepalive_is_set_on_a_connection_between_hosts() -> None:
    with socket.socket() as sock:
        ra.keep_alive(sock)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == ra.KEEPALIVE_IDLE_S
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == ra.KEEPALIVE_PROBES


async def serving_agent(key: bytes) -> tuple[asyncio.Server, int]:
    server = await Agent(key).serve("127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_supervisor_with_the_key_gets_a_port_and_one_without_is_refused() -> None:
    async def main() -> None:
        server, port = await serving_agent(KEY)
        async with server:
            client = await Client.connect(f"127.0.0.1:{port}", KEY)
            assert client.address == "127.0.0.1" and client.port > 0
            client.close()
            with pytest.raises(EOFError, match="refused us: wrong key"):
                await Client.connect(f"127.0.0.1:{port}", b"fedcba9876543210fedcba9876543210")

    asyncio.run(main())


def test_an_agent_that_cannot_prove_the_key_is_not_trusted() -> None:
    """A listener that answers the handshake without the key (an impostor) is refused by the supervisor."""
    done = asyncio.Event()

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await ra.send(writer, ra.Challenge(ra.nonce()))
            await ra.recv(reader)
            await ra.send(writer, ra.Welcome(b"\0" * 32))
            await reader.read()
        finally:
            writer.close()
            done.set()

    async def main() -> None:
        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        async with server:
            port = server.sockets[0].getsockname()[1]
            with pytest.raises(EOFError, match="does not hold the group's key"):
                await Client.connect(f"127.0.0.1:{port}", KEY)
            await asyncio.wait_for(done.wait(), 5)

    asyncio.run(main())


def test_a_peer_that_says_nothing_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_mod, "HANDSHAKE_S", 0.3)

    async def main() -> None:
        server, port = await serving_agent(KEY)
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert isinstance(await ra.recv(reader), ra.Challenge)
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed on us after the handshake's time
            writer.close()

    asyncio.run(main())


def test_a_proof_made_for_another_agent_is_refused() -> None:
    """A listener posing as one agent cannot relay another agent's challenge: the supervisor's
    proof names the address it dialed, which is not the real agent's."""
    async def main() -> None:
        server, port = await serving_agent(KEY)
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            challenge = await ra.recv(reader)
            ours = ra.nonce()
            elsewhere = b"127.0.0.1:1"  # what a supervisor dialing the impostor would have signed
            await ra.send(writer, ra.Proof(ra.mac(KEY, b"supervisor", challenge.nonce, ours, elsewhere), ours))
            answer = await ra.recv(reader)
            assert isinstance(answer, ra.Refused) and answer.why == "wrong key"
            writer.close()

    asyncio.run(main())


def test_a_start_passes_on_only_mlx_nccl_and_mlxd_variables() -> None:
    env = {"MLX_RANK": "1", "NCCL_PORT": "9", "MLXD_GROUP_TOKEN": "t", "CUDA_VISIBLE_DEVICES": "0",
           "LD_PRELOAD": "/tmp/evil.so", "PYTHONPATH": "/tmp/evil", "PATH": "/tmp"}
    assert ra.allowed_env(env) == {"MLX_RANK": "1", "NCCL_PORT": "9", "MLXD_GROUP_TOKEN": "t",
                                   "CUDA_VISIBLE_DEVICES": "0"}
