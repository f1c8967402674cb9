"""`mlxd rank`: the agent through which a supervisor on another host starts this host's rank of
an engine group (docs/distributed.md; what they say: protocol/rank_agent.py).

Each connection is one rank: the supervisor proves it holds the key (and the agent proves it
back), asks for a free port for the ring, then starts the rank, a `python -m mlxd.engine` of
rank 0's command line, whose log and exit the agent sends back. When the connection drops (the
supervisor stopped the group, died, or its host vanished) the rank is killed at once: a rank
waiting in a collective heeds nothing gentler. Nothing here imports mlx.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path

import psutil

from mlxd.protocol import rank_agent as ra

log = logging.getLogger("mlxd.rank")
HANDSHAKE_S = 10.0  # a peer that has not proven itself in this long is dropped
LINE_LIMIT = 16 << 20  # the longest line of a rank's log read (asyncio's default, 64 KiB, ends the read)
LINE_SENT = 1 << 20  # ... and the most of it sent on: a frame past MAX_FRAME would end the connection


class Agent:
    def __init__(self, key: bytes, module: str = "mlxd.engine", memory_cap: int | None = None) -> None:
        self._key = key
        self._module = module  # the engine's module (tests start a faulty one)
        self._memory_cap = memory_cap  # `--memory-gb`: the most this host gives ranks
        self._ranks: set[asyncio.subprocess.Process] = set()

    async def serve(self, host: str, port: int) -> asyncio.Server:
        server = await asyncio.start_server(self._connection, host, port)
        where = ", ".join(f"{s.getsockname()[0]}:{s.getsockname()[1]}" for s in server.sockets)
        log.info("mlxd rank: listening on %s for a supervisor's ranks", where)
        return server

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        ra.keep_alive(writer.get_extra_info("socket"))  # a supervisor whose host vanished ends this too
        proc: asyncio.subprocess.Process | None = None
        hostfile: Path | None = None
        try:
            sealed = await asyncio.wait_for(self._handshake(reader, writer), HANDSHAKE_S)
            if sealed is None:
                log.warning("refused %s: it does not hold this host's key", peer)
                return
            while True:
                message = await sealed.recv(reader)
                if isinstance(message, ra.Reserve):
                    address = writer.get_extra_info("sockname")[0]
                    available, total = self._memory()
                    await sealed.send(writer, ra.Reserved(address, _free_port(address), available, total))
                elif isinstance(message, ra.Start) and proc is None:
                    if message.hostfile is not None:
                        fd, name = tempfile.mkstemp(prefix="mlxd-ring-", suffix=".json")  # 0600
                        os.close(fd)
                        hostfile = Path(name)
                    try:
                        proc = await self._start(message, hostfile)
                    except OSError as exc:
                        await sealed.send(writer, ra.Refused(f"cannot start the rank: {exc}"))
                        return
                    code = await self._relay(proc, reader, writer, sealed)
                    if code is not None:
                        await sealed.send(writer, ra.Exited(code))
                    return
                else:
                    await sealed.send(writer, ra.Refused(f"unexpected {type(message).__name__}"))
                    return
        except (EOFError, OSError, TimeoutError) as exc:
            log.info("connection from %s ended: %s", peer, exc or type(exc).__name__)
        finally:
            if proc is not None and proc.returncode is None:
                log.info("rank pid %d: its supervisor is gone; killing it", proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
            self._ranks.discard(proc)
            if hostfile is not None:
                hostfile.unlink(missing_ok=True)
            writer.close()

    def _memory(self) -> tuple[int, int]:
        """What this host has free for a rank, and in all (both within `--memory-gb`): the
        supervisor refuses to start a rank here that would not fit."""
        memory = psutil.virtual_memory()
        available, total = int(memory.available), int(memory.total)
        if self._memory_cap is not None:
            available, total = min(available, self._memory_cap), min(total, self._memory_cap)
        return available, total

    def kill_all(self) -> None:
        for proc in self._ranks:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> ra.Sealed | None:
        """The supervisor's proof checked and ours sent: the connection's sealed frames from here
        (None: it does not hold the key)."""
        challenge = ra.nonce()
        await ra.send(writer, ra.Challenge(challenge))
        proof = await ra.recv(reader, ra.HANDSHAKE_FRAME)
        host, port = writer.get_extra_info("sockname")[:2]
        here = f"{host}:{port}".encode()  # the supervisor's proof names the agent it dialed
        if not isinstance(proof, ra.Proof) or not hmac.compare_digest(
                proof.mac, ra.mac(self._key, b"supervisor", challenge, proof.nonce, here)):
            await ra.send(writer, ra.Refused("wrong key"))
            return None
        await ra.send(writer, ra.Welcome(ra.mac(self._key, b"agent", proof.nonce, challenge, here)))
        return ra.Sealed(ra.session_key(self._key, challenge, proof.nonce, here), b"agent", b"supervisor")

    async def _start(self, start: ra.Start, hostfile: Path | None) -> asyncio.subprocess.Process:
        env = {**os.environ, **ra.rank_env(start.env, self._key), "MLXD_PARENT_PID": str(os.getpid())}
        if hostfile is not None:
            hostfile.write_text(start.hostfile or "")
            env["MLX_HOSTFILE"] = str(hostfile)
        argv = [*start.argv, "--parent-pid", str(os.getpid())]  # the last one given wins
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", self._module, *argv, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env, limit=LINE_LIMIT)
        self._ranks.add(proc)
        log.info("rank %d pid %d starting", start.rank, proc.pid)
        return proc

    async def _relay(self, proc: asyncio.subprocess.Process, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter, sealed: ra.Sealed) -> int | None:
        """The rank's log to the supervisor until it exits (its code), or until the supervisor
        goes (None: the caller kills the rank)."""
        gone = asyncio.ensure_future(reader.read(1))  # the supervisor sends nothing more: any end is its end
        lines = asyncio.ensure_future(_lines(proc, writer, sealed))
        await asyncio.wait({gone, lines}, return_when=asyncio.FIRST_COMPLETED)
        if gone.done() or lines.exception() is not None:  # sending a line failed: gone too
            lines.cancel()
            return None
        gone.cancel()
        return await proc.wait()


async def _lines(proc: asyncio.subprocess.Process, writer: asyncio.StreamWriter, sealed: ra.Sealed) -> None:
    assert proc.stdout is not None
    async for raw in proc.stdout:
        text = raw[:LINE_SENT].decode(errors="replace").rstrip()
        if len(raw) > LINE_SENT:
            text += f" ... ({len(raw) - LINE_SENT} more bytes not relayed)"
        await sealed.send(writer, ra.Line(text))


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


async def run(host: str, port: int, key_file: Path, memory_cap: int | None = None) -> None:
    """Serve until SIGTERM or SIGINT; the ranks running then are killed."""
    agent = Agent(ra.read_key(key_file), memory_cap=memory_cap)
    server = await agent.serve(host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
        agent.kill_all()  # before the server's close, which (Python 3.12+) waits for the connections
    log.info("mlxd rank: stopped")
