"""What rank 0 of an engine group tells the other ranks (docs/distributed.md).

Every rank of a sharded model runs the same GPU loop, and every forward pass sums across the
ranks, so each must make the same model calls in the same order. Rank 0 alone takes requests;
before each turn of its loop it sends a Turn: the jobs that turn starts with (token ids and
sampling parameters, never Python objects), the jobs cancelled since the last, and whether
the engine is stopping. The others replay it. Frames are msgpack, each behind its length.

Over a Unix socket (ranks on one machine; the socket is its user's alone) frames go as they
are. Over TCP (ranks on other hosts) a follower and rank 0 first prove to each other that they
hold the group's token (Knock, Vouch, Proof: HMACs of both sides' fresh challenges; the token
never crosses the network), and every frame after carries an HMAC under a key of that
connection (`Link`, with rank_agent's Seal).
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import msgspec

from mlxd.engine.gpu.job import SamplingParams
from mlxd.engine.gpu.options import GatewayOptions
from mlxd.protocol.rank_agent import TAG, Seal, mac

HEADER = struct.Struct("!I")
MAX_FRAME = 256 * 1024 * 1024  # a Turn of many long prompts; anything larger is a broken peer


class WireJob(msgspec.Struct, array_like=True):
    """A job as a follower rebuilds it."""

    id: int  # rank 0's count of the group's jobs
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: list[str]
    logprobs: int | None
    group: tuple[int, int, int] | None  # an n > 1 request's choices: (its id, size, target)
    priority: int
    continues_text: bool
    resumed: int
    grammar: str | None  # llguidance's grammar text the reply is held to (each rank compiles its own matcher)
    speculate: bool = True  # may draft (False: the request opted out): every rank's lane must know


class Turn(msgspec.Struct, array_like=True, tag=True):
    jobs: list[WireJob]
    cancelled: list[int]  # ids of jobs whose caller left (or that a drain ended) since the last turn
    stopping: bool
    stop: bool = False  # rank 0 ends: so do the followers
    disk: list[str] = []  # SSD entries every rank holds: lookups may use them from this turn on
    flush: float | None = None  # write the RAM prompt cache to SSD first, within this many seconds


class Decide(msgspec.Struct, array_like=True, tag=True):
    """Rank 0, during a turn: a drafting decision (spec/agreement.py), which the others take."""

    value: Any


class Query(msgspec.Struct, array_like=True, tag=True):
    """Rank 0, before a turn: which of these SSD entries do you hold whole?"""

    id: int
    names: list[str]


class Held(msgspec.Struct, array_like=True, tag=True):
    """A follower's answer to a Query (it keeps them on SSD until the next turn that allows some)."""

    id: int
    names: list[str]


class Ready(msgspec.Struct):
    """A follower, once its shard is loaded (or why it could not load it)."""

    rank: int
    error: str | None = None


class Beat(msgspec.Struct, array_like=True, tag=True):
    """A follower, every heartbeat: it is alive, and how many turns it has finished."""

    turns: int


class Hello(msgspec.Struct, array_like=True, tag=True):
    """Rank 0, once loaded: what every rank starts serving with."""

    seed: int  # unseeded sampling's generator: the same draws on every rank
    options: GatewayOptions  # sized on rank 0 (width, KV budget): followers do not size themselves
    kv_layers: int = 0  # how many layers' KV rank 0 holds (a pipeline's ranks differ): its cache weighs so


class Knock(msgspec.Struct, tag=True):
    """A follower over TCP, first: its rank and its challenge to rank 0."""

    rank: int
    nonce: bytes


class Vouch(msgspec.Struct, tag=True):
    """Rank 0's answer: its proof of holding the group's token, and its challenge back."""

    mac: bytes
    nonce: bytes


class Proof(msgspec.Struct, tag=True):
    """The follower's proof; every frame after is sealed both ways."""

    mac: bytes


HANDSHAKE_FRAME = 1024  # what a TCP peer not yet proven may send
_encoder = msgspec.msgpack.Encoder()


def tcp_address(control: str) -> tuple[str, int] | None:
    """`tcp://IP:PORT` as (IP, PORT); None for a control socket that is a path."""
    if not control.startswith("tcp://"):
        return None
    host, _, port = control.removeprefix("tcp://").rpartition(":")
    return host, int(port)


class Link:
    """One control connection's frames: as they are, or sealed (`seal`: after the handshake
    over TCP). One thread sends at a time, and one receives."""

    def __init__(self, sock: socket.socket, seal: Seal | None = None) -> None:
        self.sock = sock
        self._seal = seal

    def fileno(self) -> int:  # selectors and select() take a Link as its socket
        return self.sock.fileno()

    def send(self, message: msgspec.Struct) -> None:
        self.send_encoded(_encoder.encode(message))

    def send_encoded(self, data: bytes) -> None:
        """A message encoded once for every peer (`encode`)."""
        self.sock.sendall(HEADER.pack(len(data)) + data if self._seal is None else self._seal.sealed(data))

    def recv(self, kind: Any, limit: int = MAX_FRAME, deadline: float | None = None) -> Any:
        """The next frame as `kind`; EOFError when the peer has gone or a frame fails its check
        (`deadline`, time.monotonic()'s: TimeoutError if the whole frame is not in by then)."""
        if self._seal is None:
            return recv(self.sock, kind, limit, deadline)
        (size,) = HEADER.unpack(_exactly(self.sock, HEADER.size, deadline))
        if size > limit + TAG or size < TAG:
            raise EOFError(f"a frame of {size} bytes")
        return msgspec.msgpack.decode(self._seal.opened(_exactly(self.sock, size, deadline)), type=kind)

    def close(self) -> None:
        self.sock.close()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def leader_proof(token: str, knock: bytes, ours: bytes) -> bytes:
    return mac(token.encode(), b"leader", knock, ours)


def follower_proof(token: str, knock: bytes, vouch: bytes, rank: int) -> bytes:
    return mac(token.encode(), b"follower", vouch, knock, str(rank).encode())


def link_seal(token: str, knock: bytes, vouch: bytes, leader: bool) -> Seal:
    """The sealing of one follower's connection, from both challenges under the group's token."""
    key = mac(token.encode(), b"session", knock, vouch)
    return Seal(key, b"leader", b"follower") if leader else Seal(key, b"follower", b"leader")


def send(sock: socket.socket, message: msgspec.Struct) -> None:
    data = _encoder.encode(message)
    sock.sendall(HEADER.pack(len(data)) + data)


def recv(sock: socket.socket, kind: Any, limit: int = MAX_FRAME, deadline: float | None = None) -> Any:
    """The next frame as `kind`; EOFError when the peer has gone."""
    (size,) = HEADER.unpack(_exactly(sock, HEADER.size, deadline))
    if size > limit:
        raise EOFError(f"a frame of {size} bytes")
    return msgspec.msgpack.decode(_exactly(sock, size, deadline), type=kind)


def _exactly(sock: socket.socket, size: int, deadline: float | None = None) -> bytes:
    """`size` bytes; by `deadline` if given (a peer trickling a byte at a time cannot hold us)."""
    chunks, left = [], size
    while left:
        if deadline is not None:
            if (wait := deadline - time.monotonic()) <= 0:
                raise TimeoutError("the frame did not arrive in time")
            sock.settimeout(wait)
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the peer closed the control socket")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
