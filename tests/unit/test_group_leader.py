"""Rank 0's control socket over TCP (engine/group/ranks.py's Leader, wire.py's handshake): what
connects without proving it holds the group's token, or says nothing, or sends garbage, is
dropped; the rank that proves it joins, and every frame after is sealed both ways."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from mlxd.engine.group import follower, ranks, wire
from mlxd.engine.group.wire import Beat, Knock, Link, Proof, Ready, Turn, Vouch, send
from mlxd.protocol.rank_agent import HEADER, nonce
from tests.support import free_port

TOKEN = "the-token"


def test_strangers_on_the_tcp_control_socket_are_dropped_and_the_rank_joins_sealed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXD_GROUP_TOKEN", TOKEN)
    monkeypatch.setattr(ranks, "READY_S", 0.5)
    port = free_port()
    leader = ranks.Leader(f"tcp://127.0.0.1:{port}", 2)
    joined = threading.Thread(target=leader.join, kwargs={"timeout_s": 20})
    started = time.monotonic()  # each stranger costs the join READY_S at most, however it behaves
    joined.start()
    silent = socket.create_connection(("127.0.0.1", port))  # says nothing: dropped after READY_S
    garbage = socket.create_connection(("127.0.0.1", port))
    garbage.sendall(b"\x00\x00\x00\x05hello")
    stranger = socket.create_connection(("127.0.0.1", port))  # knocks, but cannot prove the token
    send(stranger, Knock(1, nonce()))
    vouch = Link(stranger).recv(Vouch)
    send(stranger, Proof(wire.follower_proof("not-it", b"x" * 32, vouch.nonce, 1)))
    trickler = socket.create_connection(("127.0.0.1", port))  # a byte at a time, each within READY_S
    stop_trickling = threading.Event()

    def trickle() -> None:
        with contextlib.suppress(OSError):
            for byte in HEADER.pack(900) + b"x" * 900:
                if stop_trickling.wait(0.3):
                    return
                trickler.sendall(bytes([byte]))

    threading.Thread(target=trickle, daemon=True).start()
    old_style = socket.create_connection(("127.0.0.1", port))  # the token in the clear, as before
    old_style.sendall(HEADER.pack(20) + b"\x82\xa4rank\x01\xa5token\xa4the-")
    rank = follower._link(socket.create_connection(("127.0.0.1", port)), 1, tcp=True)
    rank.send(Ready(1))
    joined.join(20)
    assert not joined.is_alive() and time.monotonic() - started < 10
    assert list(leader._ranks.values()) == [1]
    stop_trickling.set()
    for sock in (silent, garbage, stranger, old_style, trickler):
        sock.settimeout(5)
        while sock.recv(1 << 16):  # the stranger got a Vouch first; then each is closed on
            pass
        sock.close()
    leader._send(Turn([], [7], stopping=False))
    assert rank.recv(Turn, deadline=time.monotonic() + 10).cancelled == [7]
    # the other way: rank 0's watch thread (the only reader of the rank's socket once it joined)
    # opens the rank's sealed beat and counts the turn finished; a beat it cannot open ends the group
    leader.turn([], stopping=False)
    rank.recv(Turn, deadline=time.monotonic() + 10)
    rank.send(Beat(1))
    deadline = time.monotonic() + 10
    while leader._sent and leader._lost is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert leader._lost is None and not leader._sent
    leader.close()
    rank.close()


def test_a_follower_refuses_a_rank_0_that_cannot_prove_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXD_GROUP_TOKEN", TOKEN)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def impostor() -> None:
        peer, _ = server.accept()
        knock = Link(peer).recv(Knock)
        ours = nonce()
        send(peer, Vouch(wire.leader_proof("a guess", knock.nonce, ours), ours))
        peer.recv(1)
        peer.close()

    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(EOFError, match="does not hold the group's token"):
        follower._link(socket.create_connection(("127.0.0.1", port)), 1, tcp=True)
    server.close()


def test_sealed_control_frames_arrive_only_as_sent_in_their_order() -> None:
    """A Turn altered, injected, replayed or reflected on the link ends the connection (and the
    group): each frame's HMAC covers its direction and its place in the sequence."""
    knock, vouch = nonce(), nonce()
    opened: list[socket.socket] = []

    def pair() -> tuple[Link, Link, socket.socket]:
        a, b = socket.socketpair()
        opened.extend((a, b))
        leader = Link(a, wire.link_seal(TOKEN, knock, vouch, leader=True))
        return leader, Link(b, wire.link_seal(TOKEN, knock, vouch, leader=False)), a

    leader, rank, raw = pair()
    leader.send(Turn([], [1], False))
    assert rank.recv(Turn).cancelled == [1]
    frame = HEADER.pack(0)  # a plain frame, as an attacker without the key would inject
    raw.sendall(wire.HEADER.pack(len(wire.encode(Turn([], [2], False)))) + wire.encode(Turn([], [2], False)))
    with pytest.raises(EOFError):
        rank.recv(Turn)

    leader, rank, raw = pair()
    captured: list[bytes] = []
    seal = wire.link_seal(TOKEN, knock, vouch, leader=True)
    captured.append(seal.sealed(wire.encode(Turn([], [1], False))))
    captured.append(seal.sealed(wire.encode(Turn([], [2], False))))
    raw.sendall(captured[0] + captured[0])  # the first, replayed
    assert rank.recv(Turn).cancelled == [1]
    with pytest.raises(EOFError, match="failed its check"):
        rank.recv(Turn)

    leader, rank, raw = pair()
    forged = bytearray(captured[0])
    forged[-40] ^= 1  # one bit of the turn changed on the way
    raw.sendall(bytes(forged))
    with pytest.raises(EOFError, match="failed its check"):
        rank.recv(Turn)

    leader, rank, raw = pair()
    back = wire.link_seal(TOKEN, knock, vouch, leader=False).sealed(wire.encode(Turn([], [3], False)))
    raw.sendall(back)  # a follower's own frame reflected to it as if rank 0's
    with pytest.raises(EOFError, match="failed its check"):
        rank.recv(Turn)
    assert frame  # (the empty plain header is what a sealed link refuses outright)
    _, short, raw = pair()
    raw.sendall(frame)
    with pytest.raises(EOFError, match="a frame of 0 bytes"):
        short.recv(Turn)
    for sock in opened:
        sock.close()
