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


async def serving_agent(key: bytes, memory_cap: int | None = None) -> tuple[asyncio.Server, int]:
    server = await Agent(key, memory_cap=memory_cap).serve("127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_supervisor_with_the_key_gets_a_port_and_one_without_is_refused() -> None:
    async def main() -> None:
        server, port = await serving_agent(KEY)
        async with server:
            client = await Client.connect(f"127.0.0.1:{port}", KEY)
            assert client.address == "127.0.0.1" and client.port > 0
            assert 0 < client.memory_available <= client.memory_total  # this host's, as psutil says
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


def test_a_start_passes_on_only_mlx_nccl_and_mlxd_variables_and_the_token_derived_here() -> None:
    """The group's token never crosses the network: a Start carries a nonce, and the agent gives
    its rank the token derived from it under the shared key, as the supervisor gave rank 0."""
    env = {"MLX_RANK": "1", "NCCL_PORT": "9", ra.NONCE_VARIABLE: "n1", "CUDA_VISIBLE_DEVICES": "0",
           "LD_PRELOAD": "/tmp/evil.so", "PYTHONPATH": "/tmp/evil", "PATH": "/tmp"}
    token = ra.group_token(KEY, "n1")
    assert ra.rank_env(env, KEY) == {"MLX_RANK": "1", "NCCL_PORT": "9", "MLXD_GROUP_TOKEN": token,
                                     "CUDA_VISIBLE_DEVICES": "0"}
    assert token not in repr(env) and token != ra.group_token(KEY, "n2") != ra.group_token(b"another key", "n1")
    sent = {**env, "MLXD_GROUP_TOKEN": "chosen by whoever sent the Start"}
    assert ra.rank_env(sent, KEY)["MLXD_GROUP_TOKEN"] == token
    assert "MLXD_GROUP_TOKEN" not in ra.rank_env({"MLX_RANK": "1", "MLXD_GROUP_TOKEN": "t"}, KEY)


def test_new_key_writes_a_private_key_and_keeps_one_that_exists_unless_forced(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from mlxd.cli.rank_cmds import rank

    path = tmp_path / "keys" / "rank.key"
    runner = CliRunner()
    got = runner.invoke(rank, ["--new-key", "--key-file", str(path)])
    assert got.exit_code == 0, got.output
    first = ra.read_key(path)  # private, long enough
    assert path.stat().st_mode & 0o777 == 0o600
    again = runner.invoke(rank, ["--new-key", "--key-file", str(path)])
    assert again.exit_code == 1
    assert "already holds a key" in again.output and "--force" in again.output
    assert ra.read_key(path) == first  # the other hosts' copies still match
    path.chmod(0o644)
    forced = runner.invoke(rank, ["--new-key", "--force", "--key-file", str(path)])
    assert forced.exit_code == 0, forced.output
    assert ra.read_key(path) != first and path.stat().st_mode & 0o777 == 0o600
    alone = runner.invoke(rank, ["--force", "--key-file", str(path)])
    assert alone.exit_code == 2 and "--force goes with --new-key" in alone.output


def test_an_agent_says_the_memory_it_gives_ranks_within_its_cap() -> None:
    async def main() -> None:
        server, port = await serving_agent(KEY, memory_cap=1_000_000)
        async with server:
            client = await Client.connect(f"127.0.0.1:{port}", KEY)
            assert client.memory_available == client.memory_total == 1_000_000
            client.close()

    asyncio.run(main())


class Pipe:
    """Both ends of a sealed connection in one process: what one writes the other reads."""

    def __init__(self) -> None:
        self.reader = asyncio.StreamReader()
        self.sent: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.sent.append(data)

    async def drain(self) -> None:
        pass

    def deliver(self, frame: bytes) -> None:
        self.reader.feed_data(frame)


def test_sealed_frames_arrive_only_as_sent_in_their_order() -> None:
    """After the handshake each frame carries an HMAC of its place in the sequence under the
    connection's own key: an altered, injected, replayed or reordered frame ends the connection."""
    key = ra.session_key(KEY, b"a" * 32, b"s" * 32, b"10.0.0.2:8766")
    assert key != ra.session_key(KEY, b"a" * 32, b"s" * 32, b"10.0.0.3:8766")  # another agent, another key

    async def main() -> None:
        supervisor, agent = ra.Sealed(key, b"supervisor", b"agent"), ra.Sealed(key, b"agent", b"supervisor")
        pipe = Pipe()
        await supervisor.send(pipe, ra.Reserve())  # type: ignore[arg-type]
        await supervisor.send(pipe, ra.Start(1, ["--model", "m"], {}, None))  # type: ignore[arg-type]
        first, second = pipe.sent
        pipe.deliver(first)
        assert isinstance(await agent.recv(pipe.reader), ra.Reserve)
        pipe.deliver(first)  # the first again, replayed
        with pytest.raises(EOFError, match="failed its check"):
            await agent.recv(pipe.reader)

        agent = ra.Sealed(key, b"agent", b"supervisor")
        pipe.deliver(second)  # out of order
        with pytest.raises(EOFError, match="failed its check"):
            await agent.recv(pipe.reader)

        agent = ra.Sealed(key, b"agent", b"supervisor")
        pipe.deliver(first)
        await agent.recv(pipe.reader)
        forged = bytearray(second)
        forged[10] ^= 1  # one bit of the command line changed on the way
        pipe.deliver(bytes(forged))
        with pytest.raises(EOFError, match="failed its check"):
            await agent.recv(pipe.reader)

        agent = ra.Sealed(key, b"agent", b"supervisor")
        pipe.deliver(first)
        await agent.recv(pipe.reader)
        pipe.deliver(second)
        assert (await agent.recv(pipe.reader)).argv == ["--model", "m"]

        back = Pipe()  # the agent's own frame reflected back to it as if the supervisor's
        await ra.Sealed(key, b"agent", b"supervisor").send(back, ra.Line("x"))  # type: ignore[arg-type]
        back.deliver(back.sent[0])
        with pytest.raises(EOFError, match="failed its check"):
            await ra.Sealed(key, b"agent", b"supervisor").recv(back.reader)

        unsealed = Pipe()  # a plain frame, as before the handshake, where a sealed one is due
        await ra.send(unsealed, ra.Reserve())  # type: ignore[arg-type]
        unsealed.deliver(unsealed.sent[0])
        with pytest.raises(EOFError):
            await ra.Sealed(key, b"agent", b"supervisor").recv(unsealed.reader)

    asyncio.run(main())


def test_a_rank_log_line_longer_than_a_frame_is_cut_not_the_connection() -> None:
    """A rank that prints a 5 MB line (a tensor dumped, say): the supervisor gets its first MB and
    how much was left out; a frame past MAX_FRAME would have ended the connection, and the rank."""
    key = ra.session_key(KEY, b"a" * 32, b"s" * 32, b"127.0.0.1:1")

    class Rank:
        def __init__(self, lines: list[bytes]) -> None:
            self.stdout = asyncio.StreamReader(limit=agent_mod.LINE_LIMIT)
            for line in lines:
                self.stdout.feed_data(line)
            self.stdout.feed_eof()

    async def main() -> list[str]:
        pipe = Pipe()
        big = b"x" * (5 << 20) + b"\n"
        await agent_mod._lines(Rank([b"loading\n", big]), pipe, ra.Sealed(key, b"agent", b"supervisor"))  # type: ignore[arg-type]
        supervisor = ra.Sealed(key, b"supervisor", b"agent")
        for frame in pipe.sent:
            assert len(frame) <= ra.HEADER.size + ra.MAX_FRAME + ra.TAG
            pipe.deliver(frame)
        return [(await supervisor.recv(pipe.reader)).text for _ in pipe.sent]

    first, second = asyncio.run(main())
    assert first == "loading"
    assert second.startswith("x" * 1000) and len(second) < 2 << 20
    assert second.endswith(f"({(5 << 20) + 1 - agent_mod.LINE_SENT} more bytes not relayed)")


def test_the_group_token_reaches_rank_0_here_and_the_remote_rank_only_as_a_nonce(tmp_path: Path) -> None:
    """The supervisor gives rank 0 the token; the Start to the other host's agent carries only a
    nonce (Starts are sealed, not encrypted), from which that agent derives the same token."""
    from mlxd.protocol.group import GroupSpec
    from mlxd.supervisor.engines.ranks import Ranks

    key_path = tmp_path / "rank.key"
    key_path.write_text(KEY.decode())
    key_path.chmod(0o600)

    async def main() -> None:
        server, port = await serving_agent(KEY)
        async with server:
            spec = GroupSpec(ranks=2, hosts=["127.0.0.1", f"127.0.0.1:{port}"], key_file=str(key_path))
            ranks = Ranks("m", spec, tmp_path)
            assert await ranks.prepare() is None
            token = ranks.env(0)["MLXD_GROUP_TOKEN"]
            remote = ranks.remote_env(1, {"MLXD_GROUP_TOKEN": "rank 0's, passed down by mistake", "MLX_X": "1"})
            assert "MLXD_GROUP_TOKEN" not in remote and token not in repr(remote) and remote["MLX_X"] == "1"
            assert ra.rank_env(remote, KEY)["MLXD_GROUP_TOKEN"] == token  # what the agent gives its rank
            first = token
            assert await ranks.prepare() is None  # each start of the group has a token of its own
            assert ranks.env(0)["MLXD_GROUP_TOKEN"] != first
            await ranks.kill(0)

    asyncio.run(main())
