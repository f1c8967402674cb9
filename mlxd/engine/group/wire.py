"""What rank 0 of an engine group tells the other ranks (docs/distributed.md).

Every rank of a sharded model runs the same GPU loop, and every forward pass sums across the
ranks, so each must make the same model calls in the same order. Rank 0 alone takes requests;
before each turn of its loop it sends a Turn: the jobs that turn starts with (token ids and
sampling parameters, never Python objects), the jobs cancelled since the last, and whether
the engine is stopping. The others replay it. Frames are msgpack, each behind its length.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgspec

from mlxd.engine.gpu.job import SamplingParams
from mlxd.engine.gpu.options import GatewayOptions

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


class Turn(msgspec.Struct, array_like=True, tag=True):
    jobs: list[WireJob]
    cancelled: list[int]  # ids of jobs whose caller left (or that a drain ended) since the last turn
    stopping: bool
    stop: bool = False  # rank 0 ends: so do the followers
    disk: list[str] = []  # SSD entries every rank holds: lookups may use them from this turn on
    flush: float | None = None  # write the RAM prompt cache to SSD first, within this many seconds


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
    token: str = ""  # over TCP: the group's token, which the supervisor gave every rank


class Beat(msgspec.Struct, array_like=True, tag=True):
    """A follower, every heartbeat: it is alive, and how many turns it has finished."""

    turns: int


class Hello(msgspec.Struct, array_like=True, tag=True):
    """Rank 0, once loaded: what every rank starts serving with."""

    seed: int  # unseeded sampling's generator: the same draws on every rank
    options: GatewayOptions  # sized on rank 0 (width, KV budget): followers do not size themselves
    kv_layers: int = 0  # how many layers' KV rank 0 holds (a pipeline's ranks differ): its cache weighs so


_encoder = msgspec.msgpack.Encoder()


def tcp_address(control: str) -> tuple[str, int] | None:
    """`tcp://IP:PORT` as (IP, PORT); None for a control socket that is a path."""
    if not control.startswith("tcp://"):
        return None
    host, _, port = control.removeprefix("tcp://").rpartition(":")
    return host, int(port)


def send(sock: socket.socket, message: msgspec.Struct) -> None:
    data = _encoder.encode(message)
    sock.sendall(HEADER.pack(len(data)) + data)


def recv(sock: socket.socket, kind: Any, limit: int = MAX_FRAME) -> Any:
    """The next frame as `kind`; EOFError when the peer has gone."""
    (size,) = HEADER.unpack(_exactly(sock, HEADER.size))
    if size > limit:
        raise EOFError(f"a frame of {size} bytes")
    return msgspec.msgpack.decode(_exactly(sock, size), type=kind)


def _exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the peer closed the control socket")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
