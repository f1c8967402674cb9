"""Generation checkpoints on real engines (gpu/checkpoints.py, docs/resume.md): a running
reply's KV reaches the SSD tier every N tokens in either lane (the first whole, the next ones
a chain of deltas, each on the one before), and a reply continued on a new engine
after a SIGKILL starts from the checkpoint (it prefills only what followed it) and gives the
uninterrupted text (the new engine restores the checkpoint while it starts, from the list of
running rows' checkpoints the dead one left). Engines killed while checkpoints are being written leave only whole files."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.engine.cache import kv_files
from mlxd.engine.cache.ssd_tier import SsdTier
from mlxd.engine.gpu.checkpoints import CHAIN
from mlxd.protocol.process import MARKS_HEADER, REPLY_HEADER
from tests.support import EngineProcess, engine_client, running_engine, wait_for

EVERY = 16
PROMPT = "the keeper lit the lamp and wrote another letter " * 12
BODY = {"prompt": PROMPT, "max_tokens": 90, "temperature": 0, "logit_bias": {"2": -100}}


def checkpoint_args(kv: Path, *more: str) -> tuple[str, ...]:
    # write-behind off: the tier holds what checkpoints wrote, not the idle engine's entries
    return ("--generation-checkpoint", str(EVERY), "--ssd-write-behind", "off", "--ssd-cache-dir", str(kv), *more)


def tier_of(kv: Path) -> SsdTier:
    """The tier as the next engine's scan finds it (temp files deleted, damaged ones quarantined)."""
    (tier_dir,) = [p for p in kv.iterdir() if p.is_dir()]
    return SsdTier(tier_dir, 1 << 40)


def longest_file(kv: Path, files: str = "*/*") -> int:
    """Tokens of the longest whole file in the tier, read from headers only (0: none yet);
    `files`: where under `kv` (one tier's own: "*")."""
    best = 0
    for p in kv.glob(files + kv_files.SUFFIX):
        try:
            best = max(best, len(kv_files.read_header(p).tokens))
        except (OSError, kv_files.CorruptFile, ValueError):
            continue
    return best


def marked_ids(engine: EngineProcess, body: dict[str, Any]) -> tuple[str, list[int], str]:
    """A whole marked stream: its reply header, every token id the marks named, and its text."""
    with engine_client(engine) as c, c.stream("POST", "/v1/completions", json={**body, "stream": True},
                                              headers={MARKS_HEADER: "1"}) as resp:
        assert resp.status_code == 200
        reply = resp.headers[REPLY_HEADER]
        raw = resp.read()
    return reply, ids_in(raw), text_in(raw)


def ids_in(raw: bytes) -> list[int]:
    ids: list[int] = []
    for line in raw.split(b"\n"):
        if line.startswith(b": ids "):
            ids += [int(i) for i in line.split(b" ")[4].split(b",") if i]
    return ids


def text_in(raw: bytes) -> str:
    return "".join(json.loads(line[6:])["choices"][0]["text"] for line in raw.split(b"\n")
                   if line.startswith(b"data: {") and json.loads(line[6:])["choices"])


@pytest.mark.parametrize("batch", ["1", "4"])
def test_a_long_reply_leaves_its_latest_checkpoint_in_the_ssd_tier(tiny_model: Path, tmp_path: Path,
                                                                   batch: str) -> None:
    kv = tmp_path / "kv"
    with running_engine(tiny_model, "tiny", *checkpoint_args(kv, "--batch", batch)) as engine:
        prompt_tokens = engine.client.post("/v1/completions", json=BODY).json()["usage"]["prompt_tokens"]
        stats = engine.client.get("/admin/stats").json()["prompt_cache"]
        # the prompt at the first token, then every 16 tokens of the 90 generated
        assert stats["checkpoints"] == 1 + (90 - 1) // EVERY
        assert stats["checkpoints_skipped"] == 0
        wait_for(lambda: engine.client.get("/admin/stats").json()["prompt_cache"]["writes_pending"] == 0)
        ssd = engine.client.get("/admin/stats").json()["prompt_cache"]["ssd"]
        assert ssd["writes"] == stats["checkpoints"]
        tier = SsdTier(Path(ssd["dir"]), 1 << 40)
        # the first checkpoint (the prompt) whole; each later one a delta on the one before (only
        # the KV after it): a chain, each token written once
        whole, *deltas = files = sorted(tier.entries(), key=lambda e: len(e.tokens))
        assert len(whole.tokens) == prompt_tokens and whole.base is None
        assert len(deltas) == stats["checkpoints"] - 1
        for before, delta in zip(files, deltas, strict=False):
            assert (delta.base, delta.start) == (before.name, len(before.tokens))
            assert delta.size * 3 < whole.size
        assert 5 * EVERY - 1 <= len(deltas[-1].tokens) - prompt_tokens <= 5 * EVERY  # the last of 90 tokens' checkpoints
        assert tier.chain(deltas[-1]) == files
        # the reply ended: the engine's list of running rows' checkpoints names none (live_rows.py)
        assert json.loads((tier.dir / f"live-{engine.proc.pid}.json").read_text()) == []


def test_a_next_turn_stands_its_first_checkpoint_on_the_reply_before(tiny_model: Path, tmp_path: Path) -> None:
    """An agent's next turn (the transcript so far, and more) came from the prompt cache: its first
    checkpoint is a delta on the last file of the reply before it, not its whole history again."""
    kv = tmp_path / "kv"
    first = {"prompt": list(range(5, 125)), "max_tokens": 40, "temperature": 0, "logit_bias": {"2": -100}}
    with running_engine(tiny_model, "tiny", *checkpoint_args(kv)) as engine:
        _, ids, _ = marked_ids(engine, first)
        assert len(ids) >= 32  # (the batch that ends a reply carries no mark: its ids are not named)
        wait_for(lambda: engine.client.get("/admin/stats").json()["prompt_cache"]["writes_pending"] == 0)
        tier = tier_of(kv)
        before = {e.name: e for e in tier.entries()}
        newest = max(before.values(), key=lambda e: len(e.tokens))  # the reply's last checkpoint
        turn = {**first, "prompt": [*first["prompt"], *ids, *range(300, 320)], "max_tokens": 20}
        assert engine.client.post("/v1/completions", json=turn).json()["usage"]["completion_tokens"] == 20
        wait_for(lambda: engine.client.get("/admin/stats").json()["prompt_cache"]["writes_pending"] == 0)
        stats = engine.client.get("/admin/stats").json()["prompt_cache"]
        tier = tier_of(kv)  # (before the engine's stop writes its RAM entries too)
    assert stats["tokens_reused"] >= 120 + len(ids) - 1  # the turn's prompt came from the cache (the reply's RAM entry)
    added = sorted((e for e in tier.entries() if e.name not in before), key=lambda e: len(e.tokens))
    assert added and len(added[0].tokens) == len(turn["prompt"])  # the turn's first: its prompt
    assert (added[0].base, added[0].start) == (newest.name, len(newest.tokens))
    whole = min(before.values(), key=lambda e: len(e.tokens))  # the first reply's prompt, the one whole file
    assert added[0].size * 3 < whole.size  # the turn's new tokens' KV and the few the file before lacks
    assert [e.name for e in tier.entries() if e.base is None] == [whole.name]


def test_a_long_chain_of_deltas_starts_again_from_a_whole_file(tiny_model: Path, tmp_path: Path) -> None:
    """Past CHAIN deltas the next checkpoint is whole, and it makes the first chain redundant."""
    kv = tmp_path / "kv"
    every = 4
    body = {**BODY, "max_tokens": every * (CHAIN + 8)}
    with running_engine(tiny_model, "tiny", "--generation-checkpoint", str(every), "--ssd-write-behind", "off",
                        "--ssd-cache-dir", str(kv)) as engine:
        reply = engine.client.post("/v1/completions", json=body).json()
        assert reply["usage"]["completion_tokens"] == body["max_tokens"]
        wait_for(lambda: engine.client.get("/admin/stats").json()["prompt_cache"]["writes_pending"] == 0)
        stats = engine.client.get("/admin/stats").json()["prompt_cache"]
        assert stats["checkpoints_skipped"] == 0 and stats["ssd"]["writes"] == stats["checkpoints"] > CHAIN + 2
        tier = tier_of(kv)
        (whole,) = [e for e in tier.entries() if e.base is None]  # the prompt's file went with its chain
        assert len(whole.tokens) >= reply["usage"]["prompt_tokens"] + every * CHAIN
        rest = [e for e in tier.entries() if e is not whole]
        assert rest and all((tier.chain(e) or [None])[0] is whole for e in rest)
        assert max(len(tier.chain(e) or []) for e in rest) == len(rest) + 1 <= CHAIN + 1


@pytest.mark.parametrize("bits", [None, "8"])
def test_quantized_kv_checkpoints_whole_files_plain_kv_a_chain(head64_model: Path, tmp_path: Path,
                                                               bits: str | None) -> None:
    """Plain KV: the prompt's file, then a delta every `interval` tokens, each on the one before.
    Quantized KV makes no deltas: each checkpoint is a whole file, making the one before
    redundant."""
    kv, every = tmp_path / "kv", 200
    body = {**BODY, "prompt": PROMPT * 3, "max_tokens": 450}
    args = ("--generation-checkpoint", str(every), "--ssd-write-behind", "off", "--ssd-cache-dir", str(kv),
            *(("--kv-bits", bits, "--kv-group-size", "32") if bits else ()))
    with running_engine(head64_model, "h64", *args) as engine:
        reply = engine.client.post("/v1/completions", json=body).json()
        assert reply["usage"]["prompt_tokens"] >= every  # its first checkpoint at its first token
        wait_for(lambda: engine.client.get("/admin/stats").json()["prompt_cache"]["writes_pending"] == 0)
        stats = engine.client.get("/admin/stats").json()["prompt_cache"]
        assert stats["checkpoints"] == 1 + (450 - 1) // every and stats["checkpoints_skipped"] == 0
        files = sorted(tier_of(kv).entries(), key=lambda e: len(e.tokens))
        assert files[0].base is None
        if bits:
            assert len(files) == 1
        else:
            assert len(files) == stats["checkpoints"]
            assert [(e.base, e.start) for e in files[1:]] == [(e.name, len(e.tokens)) for e in files[:-1]]


def test_a_reply_cut_off_by_its_client_stays_named_for_the_next_engine(tiny_model: Path, tmp_path: Path) -> None:
    """Its client (or the supervisor, whose death cancels every row) may come back for it."""
    kv = tmp_path / "kv"
    with running_engine(tiny_model, "tiny", *checkpoint_args(kv)) as engine:
        with engine_client(engine) as c, c.stream("POST", "/v1/completions", json={**BODY, "stream": True},
                                                  headers={MARKS_HEADER: "1"}) as resp:
            read_until(resp, 40)  # then the client goes
        wait_for(lambda: engine.client.get("/admin/stats").json()["requests"]["cancelled"] == 1, timeout=10,
                 message="the reply was not cut off")
        (listed,) = kv.glob(f"*/live-{engine.proc.pid}.json")
        (names,) = json.loads(listed.read_text())
        # a reply that ends is not named (its answer leaves before the turn that ended it forgets it);
        # another prompt, whose checkpoints do not replace the cut one's
        other = {**BODY, "prompt": "the ships came in at dawn with salt and news " * 12}
        assert engine.client.post("/v1/completions", json=other).status_code == 200
        wait_for(lambda: json.loads(listed.read_text()) == [names], timeout=5,
                 message=lambda: f"named: {listed.read_text()}")
        assert (listed.parent / names[0]).exists()  # its newest checkpoint, on disk


def test_checkpoint_zero_writes_none(tiny_model: Path, tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    with running_engine(tiny_model, "tiny", "--generation-checkpoint", "0", "--ssd-write-behind", "off",
                        "--ssd-cache-dir", str(kv)) as engine:
        assert engine.client.post("/v1/completions", json=BODY).status_code == 200
        stats = engine.client.get("/admin/stats").json()["prompt_cache"]
        assert stats["checkpoints"] == 0 and stats["ssd"]["writes"] == 0


def read_until(resp: httpx.Response, want: int) -> tuple[list[int], str]:
    """Read a marked stream until its marks have named `want` token ids: the ids, and the text
    of the events those marks close."""
    got: list[int] = []
    text = ""
    buf = b""
    for chunk in resp.iter_raw():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b": ids "):
                got += [int(i) for i in line.split(b" ")[4].split(b",") if i]
                if len(got) >= want:
                    return got, text
            elif line.startswith(b"data: {") and (choices := json.loads(line[6:])["choices"]):
                text += choices[0]["text"]
    raise AssertionError(f"the stream ended after {len(got)} tokens")


def test_a_reply_continued_after_a_kill_starts_from_its_checkpoint(tiny_model: Path, tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    with running_engine(tiny_model, "tiny", "--ssd-cache-bytes", "0") as plain:
        reply, want_ids, want_text = marked_ids(plain, BODY)
        prompt_tokens = plain.client.post("/v1/completions", json=BODY).json()["usage"]["prompt_tokens"]
    engine = EngineProcess(tiny_model, "tiny", *checkpoint_args(kv))
    try:
        engine.wait_ready()
        with engine_client(engine) as c, c.stream("POST", "/v1/completions", json={**BODY, "stream": True},
                                                  headers={MARKS_HEADER: "1"}) as resp:
            delivered, text = read_until(resp, 50)
            # the checkpoint after the 48th token is on disk before the kill (the engine, ahead
            # of this reader, may have written later ones)
            wait_for(lambda: longest_file(kv) >= prompt_tokens + 48, timeout=30,
                     message="no checkpoint past the 48th token reached the disk")
            (listed,) = kv.glob(f"*/live-{engine.proc.pid}.json")
            (names,) = json.loads(listed.read_text())  # the running row's checkpoints, newest first
            os.kill(engine.proc.pid, signal.SIGKILL)
    finally:
        engine.stop()
    assert delivered == want_ids[:len(delivered)] and want_text.startswith(text)
    saved = longest_file(kv)
    rid, created = reply.split(" ")
    resume = {"tokens": delivered, "id": rid, "created": int(created)}
    with running_engine(tiny_model, "tiny", *checkpoint_args(kv)) as again:
        rest = again.client.post("/v1/completions", json={**BODY, "resume": resume}).json()
        every = again.client.get("/admin/stats").json()
        stats = every["prompt_cache"]
    assert (every["requests"]["continued"], every["tokens"]["resumed"]) == (1, len(delivered))
    # the dead engine's list named the row: the new engine restored its checkpoint while it
    # started, and the continuation found it in RAM
    assert names and stats["restored_early"] == 1 and stats["hits"] == {"ram": 1, "ssd": 0}
    assert not listed.exists()
    # the prompt and the output up to the checkpoint are not prefilled again (a fetch leaves
    # the continuation's last token to run)
    assert stats["tokens_reused"] == min(saved, prompt_tokens + len(delivered) - 1) >= prompt_tokens + 48
    assert rest["choices"][0]["text"] == want_text  # a whole answer holds the delivered text too
    assert rest["usage"]["completion_tokens"] == 90


@pytest.mark.slow  # six engines started and killed: about 8 s on 2 cores
def test_engines_killed_while_checkpointing_leave_only_whole_files(tiny_model: Path, tmp_path: Path) -> None:
    rng = random.Random(29)
    kv = tmp_path / "kv"
    long_body = {**BODY, "prompt": PROMPT * 4, "max_tokens": 400}
    args = ("--generation-checkpoint", "4", "--ssd-write-behind", "off", "--ssd-cache-dir", str(kv))
    for _ in range(6):
        engine = EngineProcess(tiny_model, "tiny", *args)
        try:
            engine.wait_ready()
            with engine_client(engine) as c, c.stream("POST", "/v1/completions",
                                                      json={**long_body, "stream": True}) as resp:
                for _ in resp.iter_raw():
                    break  # generating, a checkpoint every 4 tokens
                time.sleep(rng.uniform(0.0, 0.3))
                os.kill(engine.proc.pid, signal.SIGKILL)
        finally:
            engine.stop()
        tier = tier_of(kv)
        assert not any(p.name.startswith(kv_files.TEMP_PREFIX) for p in tier.dir.iterdir())
        for entry in tier.entries():
            kv_files.verify(tier.dir / entry.name)  # whole, or it would raise CorruptFile
        assert tier.stats.quarantined == 0
    assert tier.entries()  # checkpoints were written
