"""The ranks past 0 of a model's engine group (docs/distributed.md): started beside rank 0, the
engine the pool sees, and killed with it, on this machine or, through `mlxd rank`, on the
group's other hosts (one a rank). A rank that dies ends the group: rank 0 notices on its
control socket or by its heartbeat and exits, and the engine's owner restarts all of them as
one engine."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import secrets
import sys
from pathlib import Path

from mlxd.paths import rank_key_file
from mlxd.protocol import rank_agent as ra
from mlxd.protocol.group import GroupSpec, free_port, hostfile_text, rank_env, write_hostfile

log = logging.getLogger("mlxd.supervisor")
AGENT_TIMEOUT_S = 10.0  # connecting to another host's agent and its answers
GRACE_S = 5.0  # after rank 0's end, what the others have to end on their own


class Ranks:
    def __init__(self, model_id: str, spec: GroupSpec, runtime_dir: Path) -> None:
        self.model_id = model_id
        self.spec = spec
        name = hashlib.sha256(model_id.encode()).hexdigest()[:12]
        self._socket = runtime_dir / f"g-{name}.sock"  # rank 0 listens, the others connect (one host)
        self._hostfile = runtime_dir / f"g-{name}.json"
        self._nccl_port = 0
        self._control_port = 0  # several hosts: rank 0 listens on TCP
        self._nonce = ""  # ... fresh each start: rank 0's token is derived from it under the key,
        self._token = ""  # and each other host's agent derives the same, so the token never crosses the network
        self._procs: list[asyncio.subprocess.Process] = []
        self._agents: list[Agent] = []  # the other hosts' agents, rank 1 first
        self._logs: list[asyncio.Task[None]] = []
        self.host_bytes = 0  # what one rank is booked (the pool's estimate for this machine's): each host needs it free
        self.hosts_memory: list[dict[str, object]] = []  # each other host's memory as its agent said (admin)

    @property
    def control(self) -> str:
        """Rank 0's control socket, as its `--group-control` names it."""
        return f"tcp://{self.spec.hosts[0]}:{self._control_port}" if self.spec.hosts else str(self._socket)

    def env(self, rank: int) -> dict[str, str]:
        """Rank `rank`'s mx.distributed variables (after `prepare`), and over hosts the group's
        token for rank 0, or for another rank the nonce its agent derives the token from."""
        env = rank_env(self.spec, self._hostfile, self._nccl_port, rank)
        if not self.spec.hosts:
            return env
        return {**env, "MLXD_GROUP_TOKEN": self._token} if rank == 0 else {**env, ra.NONCE_VARIABLE: self._nonce}

    def remote_env(self, rank: int, env: dict[str, str]) -> dict[str, str]:
        """What a Start to another host's agent carries for rank `rank`: never the token (its
        agent derives it from the nonce), nor this machine's hostfile path."""
        return {k: v for k, v in {**env, **self.env(rank)}.items() if k not in ("MLX_HOSTFILE", "MLXD_GROUP_TOKEN")}

    async def prepare(self) -> str | None:
        """Fresh addresses for a new start of the group: None, or why a host cannot take its rank."""
        await self.kill()
        if not self.spec.hosts:
            write_hostfile(self._hostfile, self.spec.ranks)
            self._nccl_port = free_port()
            return None
        here = self.spec.hosts[0]
        try:
            key = ra.read_key(Path(self.spec.key_file).expanduser() if self.spec.key_file else rank_key_file())
            self._control_port, self._nccl_port = free_port(here), free_port(here)
            addresses = [f"{here}:{free_port(here)}"]
        except (OSError, ValueError) as exc:
            return f"the group's key or this host's address {here}: {exc}"
        self._nonce = secrets.token_hex(16)
        self._token = ra.group_token(key, self._nonce)
        self.hosts_memory = []
        for rank, entry in enumerate(self.spec.hosts[1:], 1):
            try:
                agent = await asyncio.wait_for(Agent.connect(entry, key), AGENT_TIMEOUT_S)
            except (OSError, EOFError, TimeoutError, ValueError) as exc:
                return f"rank {rank}'s host {entry}: {exc or type(exc).__name__} (is `mlxd rank` running there?)"
            self._agents.append(agent)
            if self.host_bytes and 0 < agent.memory_available < self.host_bytes:
                return (f"rank {rank}'s host {entry} has {gb(agent.memory_available)} of memory free, and its part of "
                        f"the model needs about {gb(self.host_bytes)}")
            self.hosts_memory.append({"rank": rank, "host": entry, "memory_available": agent.memory_available,
                                      "memory_total": agent.memory_total})
            addresses.append(f"{agent.address}:{agent.port}")
        self._hostfile.write_text(hostfile_text(addresses))
        self._hostfile.chmod(0o600)
        return None

    async def start(self, module: str, argv: list[str], env: dict[str, str]) -> str | None:
        """Ranks 1..N-1 with rank 0's command line: None, or why another host's could not start."""
        for rank, agent in enumerate(self._agents, 1):
            remote = self.remote_env(rank, env)
            hostfile = self._hostfile.read_text() if self.spec.backend == "ring" else None
            try:
                await agent.start(ra.Start(rank, argv, remote, hostfile))
            except OSError as exc:
                return f"rank {rank}'s host {agent.entry}: {exc}"
            self._logs.append(asyncio.create_task(agent.relay(self.model_id, rank)))
            log.info("[%s] rank %d starting on %s", self.model_id, rank, agent.entry)
        if self.spec.hosts:
            return None
        for rank in range(1, self.spec.ranks):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", module, *argv, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, limit=1 << 24,
                env={**os.environ, **env, **self.env(rank), "MLXD_PARENT_PID": str(os.getpid())})
            self._procs.append(proc)
            assert proc.stdout is not None
            self._logs.append(asyncio.create_task(self._relay(rank, proc.stdout)))
            log.info("[%s] rank %d pid %d starting", self.model_id, rank, proc.pid)
        return None

    async def kill(self, grace_s: float = GRACE_S) -> None:
        """End every rank past 0: those that end on their own within `grace_s` (rank 0 has gone;
        one writing its prompt cache to SSD finishes first), then the rest with SIGKILL (a rank
        waiting in a collective heeds nothing gentler; another host's agent sends it as our
        connection closes)."""
        procs, self._procs = self._procs, []
        agents, self._agents = self._agents, []
        logs, self._logs = self._logs, []
        waits = [asyncio.ensure_future(proc.wait()) for proc in procs] + [asyncio.ensure_future(asyncio.shield(t))
                                                                           for t in logs]
        if waits:
            _, late = await asyncio.wait(waits, timeout=grace_s)
            for task in late:
                task.cancel()
        for proc in procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for agent in agents:
            agent.close()
        for proc in procs:
            await proc.wait()
        for task in logs:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _relay(self, rank: int, stream: asyncio.StreamReader) -> None:
        async for raw in stream:
            relay_line(self.model_id, rank, raw.decode(errors="replace"))


def gb(size: int) -> str:
    return f"{size / 1e9:.1f} GB"


def relay_line(model_id: str, rank: int, line: str) -> None:
    from mlxd.supervisor.engines.engine import TIMESTAMP

    log.info("[%s rank %d] %s", model_id, rank, TIMESTAMP.sub("", line.rstrip()))  # ours is added again


class Agent:
    """A connection to `mlxd rank` on another host: one rank of one start of the group."""

    def __init__(self, entry: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 reserved: ra.Reserved, sealed: ra.Sealed) -> None:
        self.entry = entry
        self.address, self.port = reserved.address, reserved.port  # the ring's address of the rank there
        self.memory_available, self.memory_total = reserved.memory_available, reserved.memory_total
        self._reader, self._writer = reader, writer
        self._sealed = sealed

    @classmethod
    async def connect(cls, entry: str, key: bytes) -> Agent:
        """Connect, prove we hold the key and check the agent does, and reserve the ring's port."""
        host, port = ra.split_host(entry)
        reader, writer = await asyncio.open_connection(host, port)
        try:
            ra.keep_alive(writer.get_extra_info("socket"))
            challenge = await ra.recv(reader, ra.HANDSHAKE_FRAME)
            if not isinstance(challenge, ra.Challenge):
                raise EOFError(f"not an mlxd rank agent (it sent {type(challenge).__name__})")
            ours, dialed = ra.nonce(), f"{host}:{port}".encode()
            await ra.send(writer, ra.Proof(ra.mac(key, b"supervisor", challenge.nonce, ours, dialed), ours))
            welcome = await ra.recv(reader, ra.HANDSHAKE_FRAME)
            if isinstance(welcome, ra.Refused):
                raise EOFError(f"it refused us: {welcome.why} (is rank.key the same on both hosts?)")
            expected = ra.mac(key, b"agent", ours, challenge.nonce, dialed)
            if not isinstance(welcome, ra.Welcome) or not secrets.compare_digest(welcome.mac, expected):
                raise EOFError("it does not hold the group's key")
            sealed = ra.Sealed(ra.session_key(key, challenge.nonce, ours, dialed), b"supervisor", b"agent")
            await sealed.send(writer, ra.Reserve())
            reserved = await sealed.recv(reader)
            if not isinstance(reserved, ra.Reserved):
                raise EOFError(f"no port reserved ({reserved})")
        except BaseException:
            writer.close()
            raise
        return cls(entry, reader, writer, reserved, sealed)

    async def start(self, start: ra.Start) -> None:
        await self._sealed.send(self._writer, start)

    async def relay(self, model_id: str, rank: int) -> None:
        """The rank's log lines into ours until it exits or the connection ends."""
        while True:
            try:
                message = await self._sealed.recv(self._reader)
            except (EOFError, OSError) as exc:
                log.info("[%s] rank %d's agent on %s: %s", model_id, rank, self.entry, exc)
                return
            if isinstance(message, ra.Line):
                relay_line(model_id, rank, message.text)
            elif isinstance(message, ra.Exited):
                log.info("[%s] rank %d on %s exited with %d", model_id, rank, self.entry, message.code)
                return
            elif isinstance(message, ra.Refused):
                log.error("[%s] rank %d on %s: %s", model_id, rank, self.entry, message.why)
                return

    def close(self) -> None:
        self._writer.close()
