"""The lists of running rows' checkpoints an engine keeps beside its SSD tier (live_rows.py):
a running engine's list is left alone, however its pid looks; a dead engine's is read once and
deleted; stale and broken lists are deleted unread; and the checkpoints a list names are in
the RAM tier before the continuation asks for them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.utils import load

from mlxd.engine.cache.live_rows import LiveRows, interrupted, restore_interrupted
from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.cache.ssd_tier import SsdTier
from tests.support import wait_for
from tests.unit.test_prefix_cache import BIG, filled, last_logits, seq, written

ENGINE = """
import sys, time
from pathlib import Path
from mlxd.engine.cache.live_rows import LiveRows
rows = LiveRows(Path(sys.argv[1]))
rows.show([["new.safetensors", "whole.safetensors"], ["other.safetensors"]])
print("shown", flush=True)
time.sleep(60)
"""


def test_a_running_engines_list_is_left_alone_and_a_dead_ones_is_read_once(tmp_path: Path) -> None:
    with subprocess.Popen([sys.executable, "-c", ENGINE, str(tmp_path)], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "shown"
            listed = tmp_path / f"live-{proc.pid}.json"
            assert json.loads(listed.read_text()) == [["new.safetensors", "whole.safetensors"], ["other.safetensors"]]
            assert interrupted(tmp_path) == [] and listed.exists()  # its engine runs
            os.kill(proc.pid, signal.SIGKILL)
            # not reaped yet (a zombie keeps its pid): the lock went with the process all the same
            got = wait_for(lambda: interrupted(tmp_path) or None, 5, message="the dead engine's list was not read")
        finally:
            proc.kill()
    assert got == [["new.safetensors", "whole.safetensors"], ["other.safetensors"]]
    assert list(tmp_path.iterdir()) == []  # the list and its lock are gone
    assert interrupted(tmp_path) == []


def test_this_engines_own_list_is_not_an_interruption(tmp_path: Path) -> None:
    rows = LiveRows(tmp_path)
    rows.show([["a.safetensors"]])
    assert interrupted(tmp_path) == []
    assert json.loads((tmp_path / f"live-{os.getpid()}.json").read_text()) == [["a.safetensors"]]
    rows.show([])
    assert json.loads((tmp_path / f"live-{os.getpid()}.json").read_text()) == []


def test_dead_lists_come_newest_first_and_stale_or_broken_ones_are_deleted_unread(tmp_path: Path) -> None:
    now = time.time()

    def left(pid: int, body: str, age_s: float) -> None:
        path = tmp_path / f"live-{pid}.json"
        path.write_text(body)
        os.utime(path, (now - age_s, now - age_s))

    left(101, json.dumps([["older.safetensors"]]), 60)
    left(102, json.dumps([["newer.safetensors", "base.safetensors"], ["second.safetensors"]]), 5)
    left(103, json.dumps([["stale.safetensors"]]), 7200)  # past MAX_AGE_S
    left(104, "{not json", 1)
    left(105, json.dumps([["../escape.safetensors"]]), 1)  # a name that is not a file of the tier
    left(106, json.dumps({"rows": 1}), 1)
    assert interrupted(tmp_path) == [["newer.safetensors", "base.safetensors"], ["second.safetensors"],
                                     ["older.safetensors"]]
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def model(tiny_model: Path):  # type: ignore[no-untyped-def]
    return load(str(tiny_model))[0]


def checkpointed(model: Any, kv_dir: Path) -> tuple[list[int], int]:
    """A dead engine's leavings: a row's whole checkpoint (40 tokens) and a delta on it (48),
    on disk, and its list naming them. The row's tokens and the files' bytes."""
    pc = PrefixCache(BIG, SsdTier(kv_dir, BIG), threading.Event())
    tokens = seq(0, 40)
    kv = filled(model, tokens)
    whole = pc.checkpoint(kv, tokens)
    longer = tokens + seq(40, 8)
    delta = pc.checkpoint(filled(model, seq(40, 8), kv), longer, whole)
    assert whole is not None and delta is not None and written(pc)
    pc.close()
    (kv_dir / "live-99999.json").write_text(json.dumps([[delta.name, whole.name], ["gone.safetensors"]]))
    assert pc.ssd is not None
    return longer, pc.ssd.bytes


def test_the_newest_checkpoint_of_each_cut_row_is_in_ram_before_it_is_asked_for(model: Any, tmp_path: Path) -> None:
    longer, _ = checkpointed(model, tmp_path / "kv")
    pc = PrefixCache(BIG, SsdTier(tmp_path / "kv", BIG), threading.Event())
    assert restore_interrupted(pc) == 1  # the row whose files are gone is passed over
    assert pc.snapshot().ram.entries == 1 and pc.snapshot().restored_early == 1
    assert pc.ssd is not None and pc.ssd.stats.restores == 2  # the delta and its base, joined
    query = longer + seq(7, 3)
    got, cached = pc.fetch(query)
    assert cached == 48 and (pc.stats.ram_hits, pc.stats.ssd_hits) == (1, 0)
    assert mx.allclose(last_logits(model, query[cached:], got), last_logits(model, query), atol=1e-4).item()
    assert not (tmp_path / "kv" / "live-99999.json").exists()
    assert restore_interrupted(pc) == 0  # read once
    pc.close()


def test_a_checkpoint_the_ram_tier_has_no_room_for_is_left_on_ssd(model: Any, tmp_path: Path) -> None:
    longer, on_disk = checkpointed(model, tmp_path / "kv")
    pc = PrefixCache(on_disk - 1, SsdTier(tmp_path / "kv", BIG), threading.Event())
    assert restore_interrupted(pc) == 0
    assert pc.snapshot().ram.entries == 0 and pc.ssd is not None and pc.ssd.stats.restores == 0
    assert pc.fetch([*longer, 5])[1] == 48 and pc.stats.ssd_hits == 1  # the continuation restores it then
    pc.close()


def test_an_engine_group_restores_nothing_early(model: Any, tmp_path: Path) -> None:
    checkpointed(model, tmp_path / "kv")
    pc = PrefixCache(BIG, SsdTier(tmp_path / "kv", BIG), threading.Event())
    pc.allow([])  # a group's rank 0: lookups see only what every rank holds
    assert restore_interrupted(pc) == 0 and pc.snapshot().ram.entries == 0
    assert (tmp_path / "kv" / "live-99999.json").exists()  # left for an engine that can use it
    pc.close()
