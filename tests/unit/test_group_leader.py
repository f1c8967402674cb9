"""Rank 0's control socket over TCP (engine/group/ranks.py's Leader): what connects without the
group's token, or says nothing, or sends garbage, is dropped, and the rank that shows the token
joins."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from mlxd.engine.group import ranks
from mlxd.engine.group.wire import Ready, send
from tests.support import free_port


def test_strangers_on_the_tcp_control_socket_are_dropped_and_the_rank_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXD_GROUP_TOKEN", "the-token")
    monkeypatch.setattr(ranks, "READY_S", 0.5)
    port = free_port()
    leader = ranks.Leader(f"tcp://127.0.0.1:{port}", 2)
    joined = threading.Thread(target=leader.join, kwargs={"timeout_s": 20})
    joined.start()
    silent = socket.create_connection(("127.0.0.1", port))  # says nothing: dropped after READY_S
    garbage = socket.create_connection(("127.0.0.1", port))
    garbage.sendall(b"\x00\x00\x00\x05hello")
    stranger = socket.create_connection(("127.0.0.1", port))
    send(stranger, Ready(1, token="not-it"))
    rank = socket.create_connection(("127.0.0.1", port))
    send(rank, Ready(1, token="the-token"))
    started = time.monotonic()
    joined.join(20)
    assert not joined.is_alive() and time.monotonic() - started < 10
    assert list(leader._ranks.values()) == [1]
    for sock in (silent, garbage, stranger):
        sock.settimeout(5)
        assert sock.recv(1) == b""  # closed on it
        sock.close()
    leader.close()
    rank.close()
