"""The Responses store: rows round trip, chains walk back in order, a TTL and an LRU byte cap
hold, a write committed before a SIGKILL is there after it, and a file it cannot read is
refused with a clear error."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mlxd.supervisor.response_store import ChainBroken, ResponseStore, StoreError


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def item(text: str) -> dict[str, object]:
    return {"type": "message", "role": "user", "content": text}


def put(store: ResponseStore, rid: str, previous: str | None = None, text: str = "x") -> None:
    store.put(rid, previous, "m", [item(f"in {rid} {text}")], [item(f"out {rid}")], {"id": rid, "object": "response"})


def test_a_response_round_trips(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3")
    put(store, "resp_1")
    got = store.get("resp_1")
    assert got is not None and got.response == {"id": "resp_1", "object": "response"}
    assert got.input == [item("in resp_1 x")] and got.output == [item("out resp_1")] and got.model == "m"
    assert store.get("resp_2") is None
    assert store.delete("resp_1") and not store.delete("resp_1")
    assert store.get("resp_1") is None and store.total_bytes == 0


def test_a_chain_walks_back_to_its_first_response_in_order(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3")
    put(store, "a")
    put(store, "b", "a")
    put(store, "c", "b")
    put(store, "b2", "a")  # a second branch from the same response
    assert [s.id for s in store.chain("c")] == ["a", "b", "c"]
    assert [s.id for s in store.chain("b2")] == ["a", "b2"]
    store.delete("b")
    with pytest.raises(ChainBroken) as info:
        store.chain("c")
    assert info.value.missing == "b"


def test_a_loop_is_a_broken_chain_not_a_hang(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3")
    put(store, "a", "b")
    put(store, "b", "a")
    with pytest.raises(ChainBroken):
        store.chain("a")


def test_rows_past_their_ttl_are_gone(tmp_path: Path) -> None:
    clock = Clock()
    store = ResponseStore(tmp_path / "r.sqlite3", ttl_s=60, clock=clock)
    put(store, "old")
    clock.now += 61
    assert store.get("old") is None  # expired: never returned
    put(store, "new")  # a write sweeps the expired rows
    assert len(store) == 1 and store.get("new") is not None


def test_the_byte_cap_evicts_the_least_recently_used(tmp_path: Path) -> None:
    clock = Clock()
    store = ResponseStore(tmp_path / "r.sqlite3", cap_bytes=10**9, clock=clock)
    for rid in "abcd":
        clock.now += 1
        put(store, rid, text="y" * 200)
    one = store.total_bytes // 4
    clock.now += 1
    store.get("a")  # a is used again: b is now the least recently used
    store.cap_bytes = 3 * one + one // 2
    clock.now += 1
    put(store, "e", text="y" * 200)
    assert {r for r in "abcde" if store.get(r) is not None} == {"a", "d", "e"}
    assert store.total_bytes <= store.cap_bytes


def test_the_byte_count_survives_a_reopen(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3")
    put(store, "a")
    put(store, "a", text="longer " * 50)  # replaced: counted once
    size = store.total_bytes
    store.close()
    assert ResponseStore(tmp_path / "r.sqlite3").total_bytes == size


def test_a_write_committed_before_a_sigkill_survives_it(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    code = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from mlxd.supervisor.response_store import ResponseStore
        store = ResponseStore(Path({str(path)!r}))
        store.put("resp_k", None, "m", [], [{{"type": "message"}}], {{"id": "resp_k"}})
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=False)
    assert proc.returncode == -9
    got = ResponseStore(path).get("resp_k")
    assert got is not None and got.response == {"id": "resp_k"}


def test_a_newer_schema_or_a_foreign_file_is_refused(tmp_path: Path) -> None:
    newer = tmp_path / "newer.sqlite3"
    db = sqlite3.connect(newer)
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(StoreError, match="schema version 99"):
        ResponseStore(newer)
    junk = tmp_path / "junk.sqlite3"
    junk.write_bytes(b"not a database at all" * 100)
    with pytest.raises(StoreError, match="not a response store"):
        ResponseStore(junk)
