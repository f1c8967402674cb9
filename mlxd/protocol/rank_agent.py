"""What a supervisor and `mlxd rank` on another host say to each other (docs/distributed.md).

A model's engine group may have ranks on other machines. On each, `mlxd rank` listens on TCP;
the supervisor that owns the group connects, and both prove they hold the same key (an HMAC of
the other's random challenge; the key never crosses the network). The supervisor then asks for
a free port for the ring and starts the host's rank with rank 0's command line; the agent
relays the rank's log and its exit, and kills it the moment the connection drops, so no rank
outlives the supervisor that started it. Frames are msgpack, each behind its length; after the
handshake each also carries an HMAC under a key of that connection (`Sealed`), so a frame that
someone on the link altered, injected, replayed or reordered ends the connection (and the rank).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import socket
import struct
from pathlib import Path
from typing import Any

import msgspec

DEFAULT_PORT = 8766
HEADER = struct.Struct("!I")
MAX_FRAME = 4 * 1024 * 1024  # a command line, a log line; anything larger is a broken peer
HANDSHAKE_FRAME = 1024  # what a peer not yet proven may send
# What a supervisor may set in a rank's environment on the agent's host (nothing that loads code)
ENV_PREFIXES = ("MLX_", "MLXD_", "NCCL_", "CUDA_VISIBLE_DEVICES", "OPENBLAS_NUM_THREADS")
NONCE_VARIABLE = "MLXD_GROUP_NONCE"  # in a Start: the agent derives the rank's MLXD_GROUP_TOKEN from it


class Challenge(msgspec.Struct, tag=True):
    nonce: bytes


class Proof(msgspec.Struct, tag=True):
    """The supervisor's answer to the agent's challenge, and its own challenge back."""

    mac: bytes
    nonce: bytes


class Welcome(msgspec.Struct, tag=True):
    mac: bytes  # the agent's answer to the supervisor's challenge


class Refused(msgspec.Struct, tag=True):
    why: str


class Reserve(msgspec.Struct, tag=True):
    """A free port on the agent's address, for the ring backend's hostfile."""


class Reserved(msgspec.Struct, tag=True):
    address: str  # the agent's side of this connection: the address the other ranks reach
    port: int
    memory_available: int = 0  # bytes the agent's host has free for its rank (0: not known)
    memory_total: int = 0


class Start(msgspec.Struct, tag=True):
    rank: int
    argv: list[str]  # after `python -m mlxd.engine`
    env: dict[str, str]  # mx.distributed's and the group's variables, the hostfile's aside
    hostfile: str | None  # the ring's hostfile, written on the agent's host


class Line(msgspec.Struct, tag=True):
    text: str  # a line of the rank's log


class Exited(msgspec.Struct, tag=True):
    code: int


Message = Challenge | Proof | Welcome | Refused | Reserve | Reserved | Start | Line | Exited
_encoder = msgspec.msgpack.Encoder()


async def send(writer: asyncio.StreamWriter, message: msgspec.Struct) -> None:
    data = _encoder.encode(message)
    writer.write(HEADER.pack(len(data)) + data)
    await writer.drain()


async def recv(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> Any:
    """The next message; EOFError when the peer has gone or sent what is not one."""
    try:
        (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        if size > limit:
            raise EOFError(f"a frame of {size} bytes")
        return msgspec.msgpack.decode(await reader.readexactly(size), type=Message)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise EOFError("the peer closed the connection") from exc
    except msgspec.DecodeError as exc:
        raise EOFError(f"not a message: {exc}") from exc


TAG = 32  # an HMAC-SHA256 after each sealed frame


class Seal:
    """The MACs of one connection's frames after its handshake: each frame is followed by an
    HMAC of its payload, its direction and its place in that direction's sequence, under a key
    only the two ends can derive, so a frame is accepted only as the next one its sender sent
    (altered, injected, replayed, reordered or reflected, it fails). `sends`, `receives`: who
    sends each way (b"supervisor" and b"agent"; b"leader" and b"follower" on an engine group's
    control socket)."""

    def __init__(self, key: bytes, sends: bytes, receives: bytes) -> None:
        self._key = key
        self._sends, self._receives = sends, receives
        self._sent = self._received = 0

    def _tag(self, who: bytes, count: int, data: bytes) -> bytes:
        return hmac.new(self._key, who + b"\0" + count.to_bytes(8, "big") + data, hashlib.sha256).digest()

    def sealed(self, data: bytes) -> bytes:
        """The next outgoing frame: its length, `data`, its tag."""
        tag = self._tag(self._sends, self._sent, data)
        self._sent += 1
        return HEADER.pack(len(data) + TAG) + data + tag

    def opened(self, frame: bytes) -> bytes:
        """The next incoming frame's payload (the length read off); EOFError if it fails its check."""
        if len(frame) < TAG:
            raise EOFError(f"a frame of {len(frame)} bytes")
        data, tag = frame[:-TAG], frame[-TAG:]
        if not hmac.compare_digest(tag, self._tag(self._receives, self._received, data)):
            raise EOFError("a frame failed its check: altered or injected on the way")
        self._received += 1
        return data


class Sealed(Seal):
    """The agent's connection after its handshake (asyncio streams)."""

    async def send(self, writer: asyncio.StreamWriter, message: msgspec.Struct) -> None:
        writer.write(self.sealed(_encoder.encode(message)))
        await writer.drain()

    async def recv(self, reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> Any:
        """The next message; EOFError when the peer has gone, or a frame fails its check."""
        try:
            (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
            if size > limit + TAG or size < TAG:
                raise EOFError(f"a frame of {size} bytes")
            frame = await reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise EOFError("the peer closed the connection") from exc
        data = self.opened(frame)
        try:
            return msgspec.msgpack.decode(data, type=Message)
        except msgspec.DecodeError as exc:
            raise EOFError(f"not a message: {exc}") from exc


def session_key(key: bytes, agent_nonce: bytes, supervisor_nonce: bytes, dialed: bytes) -> bytes:
    """The key of one connection's sealed frames: both challenges and the agent's address, under
    the shared key (only the two ends that proved they hold it can make it)."""
    return mac(key, b"session", agent_nonce, supervisor_nonce, dialed)


def group_token(key: bytes, nonce: str) -> str:
    """An engine group's token, the key of its control socket: what the supervisor gives rank 0
    and each other host's agent derives from the start's public nonce for its rank, so that the
    token itself never crosses the network."""
    return mac(key, b"group", nonce.encode()).hex()


def nonce() -> bytes:
    return secrets.token_bytes(32)


def mac(key: bytes, role: bytes, *parts: bytes) -> bytes:
    """The proof of holding `key` for `parts` (both sides' challenges, the agent's address as the
    supervisor dialed it), bound to who proves it (b"supervisor", b"agent"): a proof made for one
    agent, or one side's proof, cannot be relayed as another."""
    return hmac.new(key, b"\0".join((role, *parts)), hashlib.sha256).digest()


def allowed_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of a Start an agent passes on (MLX's, NCCL's, mlxd's own), the group's
    token aside: the agent derives it (`rank_env`)."""
    return {k: v for k, v in env.items() if k.startswith(ENV_PREFIXES) and k not in ("MLXD_GROUP_TOKEN", NONCE_VARIABLE)}


def rank_env(env: dict[str, str], key: bytes) -> dict[str, str]:
    """What an agent gives the rank a Start asks for: the allowed variables, and the group's
    token derived under its key from the Start's nonce."""
    allowed = allowed_env(env)
    if nonce_ := env.get(NONCE_VARIABLE):
        allowed["MLXD_GROUP_TOKEN"] = group_token(key, nonce_)
    return allowed


def read_key(path: Path) -> bytes:
    """The shared key: a private file's stripped contents (OSError or ValueError, said plainly)."""
    if path.stat().st_mode & 0o077:
        raise ValueError(f"{path} can be read by other users: chmod 600 it")
    key = path.read_bytes().strip()
    if len(key) < 16:
        raise ValueError(f"{path} holds no key of at least 16 bytes")
    return key


KEEPALIVE_IDLE_S, KEEPALIVE_EVERY_S, KEEPALIVE_PROBES = 5, 2, 3


def keep_alive(sock: Any) -> None:
    """TCP keepalive on a connection between hosts, so that one whose other end vanished (its
    machine off, the cable out) ends in about 11 s instead of never: a rank waiting for its
    supervisor, or for rank 0, would otherwise wait for good. (macOS names the idle time
    TCP_KEEPALIVE.)"""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = getattr(socket, "TCP_KEEPIDLE", None) or getattr(socket, "TCP_KEEPALIVE", None)
    for option, value in ((idle, KEEPALIVE_IDLE_S), (getattr(socket, "TCP_KEEPINTVL", None), KEEPALIVE_EVERY_S),
                          (getattr(socket, "TCP_KEEPCNT", None), KEEPALIVE_PROBES)):
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def split_host(entry: str) -> tuple[str, int]:
    """`IP` or `IP:PORT` of a `hosts` entry (the agent's port by default)."""
    host, _, port = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
    return host, int(port) if port else DEFAULT_PORT
