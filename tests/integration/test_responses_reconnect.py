"""A stored Responses generation cut off by a supervisor restart (SIGKILL mid-stream) is
finished when a client asks for it (responses_generations.py, docs/resume.md): the response it
gets is the one an uninterrupted run gives, it is stored, and the next engine started from the
generation checkpoint the killed one left on SSD."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.support import SupervisorProcess, wait_for

CONFIG = "[pool]\ngeneration_checkpoint = 16\n\n[models.tiny]\npath = \"{model}\"\n"
ASK = {"model": "tiny", "input": "Tell me a long story about a lighthouse keeper and the sea. " * 4,
       "max_output_tokens": 1500, "temperature": 0}


def saved_tokens(data: Path, rid: str) -> int:
    """How many of the reply's tokens the store saved for `rid` (0: none yet, or no row)."""
    db = sqlite3.connect(str(data / "responses.sqlite3"))
    try:
        row = db.execute("SELECT length(tokens) FROM generations WHERE id = ?", (rid,)).fetchone()
    finally:
        db.close()
    return int(row[0]) // 8 if row else 0


def generations(data: Path) -> int:
    """Rows of stored responses being made or cut off."""
    db = sqlite3.connect(str(data / "responses.sqlite3"))
    try:
        return int(db.execute("SELECT COUNT(*) FROM generations").fetchone()[0])
    finally:
        db.close()


def cut_off(model: Path, data: Path) -> tuple[Any, str]:
    """A supervisor whose stored stream is cut off by its SIGKILL mid-reply, its progress saved:
    the uninterrupted response (from the same supervisor, not stored), and the cut one's id."""
    sup = SupervisorProcess(CONFIG.format(model=model), data).wait_up()
    try:
        client = sup.openai()
        want = client.responses.create(**ASK, store=False)
        assert want.usage.output_tokens == 1500 and len(want.output_text) > 200
        with client.responses.create(**ASK, stream=True) as events:
            first = next(iter(events))
            assert first.type == "response.created"
            rid = first.response.id
            # mid-reply, once its progress is saved, the supervisor dies
            wait_for(lambda: saved_tokens(data, rid) >= 48, timeout=10,
                     message="no progress saved while the reply ran")
            being_made = sup.client.get(f"/v1/responses/{rid}").json()  # asked for meanwhile: as it stands
            assert (being_made["id"], being_made["status"], being_made["output"]) == (rid, "in_progress", [])
            os.kill(sup.proc.pid, signal.SIGKILL)
        assert saved_tokens(data, rid) < want.usage.output_tokens
    finally:
        sup.stop()
    return want, rid


# whole: slow (about 8 s on 2 cores, `make test` stays under 10 minutes); the stream is the fuller test
@pytest.mark.parametrize("how", [pytest.param("whole", marks=pytest.mark.slow), "stream"])
def test_a_generation_cut_off_by_a_supervisor_kill_is_finished_when_asked_for(tiny_model: Path, tmp_path: Path,
                                                                               how: str) -> None:
    data = tmp_path / "data"
    want, rid = cut_off(tiny_model, data)
    # the engine, its parent gone, exits too; the next supervisor's engine finds its checkpoint
    again = SupervisorProcess(CONFIG.format(model=tiny_model), data).wait_up()
    try:
        client = again.openai()
        if how == "whole":
            got = client.responses.retrieve(rid)
        else:  # from its start, the delivered part resent, then the rest as it is made
            resp = again.client.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": "3"})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "starting_after"
            assert saved_tokens(data, rid) > 0  # refused, it is still there to be finished
            with client.responses.retrieve(rid, stream=True) as events:
                seen = list(events)
            kinds = [e.type for e in seen]
            assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
            assert [e.sequence_number for e in seen] == list(range(len(seen)))
            text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
            assert text == want.output_text
            assert kinds.count("response.output_text.delta") > 2  # streamed, not one piece
            got = seen[-1].response
        assert got.status == want.status == "incomplete" and got.id == rid  # at max_output_tokens
        assert got.output_text == want.output_text
        assert (got.usage.input_tokens, got.usage.output_tokens) == (want.usage.input_tokens, want.usage.output_tokens)
        # it is stored now: asked again, the same, with no generation left
        assert client.responses.retrieve(rid).output_text == want.output_text
        assert saved_tokens(data, rid) == 0
        (row,) = again.client.get("/admin/engines").json()["data"]
        cache = row["prompt_cache"]
        # its checkpoint restored for it (SSD), or before it came (the engine's start, when the
        # killed supervisor's engine was gone by then: live_rows.py)
        assert cache["hits"]["ssd"] >= 1 or (cache["restored_early"] >= 1 and cache["hits"]["ram"] >= 1)
        assert cache["tokens_reused"] >= want.usage.input_tokens
        assert "was cut off after" in again.log()
        taken = re.search(r'mlxd_generation_checkpoints_total\{model="tiny",outcome="taken"\} (\d+)',
                          again.client.get("/metrics").text)
        assert taken is not None and float(taken.group(1)) >= 1  # the rest was checkpointed as it was made
        # a stored request that fails leaves no generation behind to be finished
        too_long = {**ASK, "input": "lighthouse " * 5000}
        assert again.client.post("/v1/responses", json=too_long).status_code == 400
        assert generations(data) == 0
    finally:
        again.stop()

