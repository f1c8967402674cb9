"""Pausing in a real engine: when every row is taken and a more urgent request waits, the least
urgent running row is paused (its KV to the prompt cache) and resumed once there is room,
without losing or repeating a token (mlxd/engine/gpu/scheduler.py, the lanes' pause)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.support import (
    NO_EOS,
    EngineProcess,
    complete,
    engine_client,
    lanes,
    running_engine,
    serving,
    text_of,
    wait_for,
)

LONG = 700  # tokens: the background rows are still decoding when the urgent one comes


def streamed(engine: EngineProcess, body: dict[str, Any], started: threading.Event) -> dict[str, Any]:
    """A streamed greedy completion: its text and usage; `started` is set at its first text."""
    parts: list[str] = []
    usage: dict[str, Any] = {}
    full = {"max_tokens": LONG, "temperature": 0, "logit_bias": NO_EOS, "stream": True,
            "stream_options": {"include_usage": True}, **body}
    with engine_client(engine) as c, c.stream("POST", "/v1/completions", json=full) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                parts.append(chunk["choices"][0]["text"])
                started.set()
    return {"text": "".join(parts), "usage": usage}


def run_with_an_urgent_one(engine: EngineProcess, background: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`background` prompts at priority 10, all decoding, then an urgent request at priority 0:
    the background answers and the urgent one."""
    with cf.ThreadPoolExecutor(len(background) + 1) as pool:
        running = []
        for prompt in background:
            started = threading.Event()
            running.append(pool.submit(streamed, engine, {"prompt": prompt, "priority": 10}, started))
            assert started.wait(60), engine.log()
        urgent = complete(engine, "urgent", max_tokens=8, priority=0)
        return [f.result() for f in running], urgent


@pytest.mark.parametrize("cache", ["on", "off"])
def test_a_full_batch_pauses_its_least_urgent_row_and_resumes_it_intact(tiny_model: Path, cache: str) -> None:
    prompts = ["The first background job", "The second background job"]
    extra = () if cache == "on" else ("--prompt-cache-bytes", "0")  # off: the resumed row's history runs again
    with running_engine(tiny_model, "tiny", "--batch", "2", "--prefill-step", "64", *extra) as engine:
        alone = [streamed(engine, {"prompt": p}, threading.Event()) for p in prompts]
        background, urgent = run_with_an_urgent_one(engine, prompts)
        after = lanes(engine)
        log = engine.log()
    assert urgent["status"] == 200 and urgent["usage"]["completion_tokens"] == 8
    # Token for token what each makes alone: nothing lost or repeated across the pause.
    assert [b["text"] for b in background] == [a["text"] for a in alone]
    assert [b["usage"]["completion_tokens"] for b in background] == [LONG, LONG]
    assert (after["paused_total"], after["resumed_total"], after["paused"]) == (1, 1, 0)
    assert "paused a request (priority 10)" in log


def test_the_serial_lanes_row_is_paused_at_batch_one(tiny_model: Path) -> None:
    with running_engine(tiny_model, "tiny", "--batch", "1") as engine:
        alone = streamed(engine, {"prompt": "The background job"}, threading.Event())
        [background], urgent = run_with_an_urgent_one(engine, ["The background job"])
        after = lanes(engine)
    assert urgent["status"] == 200
    assert background["text"] == alone["text"] and background["usage"]["completion_tokens"] == LONG
    assert (after["paused_total"], after["resumed_total"]) == (1, 1)


def test_equal_priorities_never_pause_each_other(tiny_model: Path) -> None:
    with running_engine(tiny_model, "tiny", "--batch", "1") as engine:
        started = threading.Event()
        with cf.ThreadPoolExecutor(2) as pool:
            running = pool.submit(streamed, engine, {"prompt": "first", "max_tokens": 200}, started)
            assert started.wait(60)
            second = complete(engine, "second", max_tokens=4)
            assert running.result()["usage"]["completion_tokens"] == 200
        assert second["status"] == 200 and lanes(engine)["paused_total"] == 0


def test_a_paused_request_whose_client_leaves_ends_and_frees_everything(tiny_model: Path) -> None:
    """The urgent request runs long; the paused one's client leaves while it waits to resume."""
    with running_engine(tiny_model, "tiny", "--batch", "1") as engine:
        started, leave = threading.Event(), threading.Event()
        cancelled = engine.stats()["requests"]["cancelled"]

        def background() -> None:
            body = {"prompt": "background", "max_tokens": LONG, "temperature": 0, "logit_bias": NO_EOS,
                    "stream": True, "priority": 10}
            with engine_client(engine) as c, c.stream("POST", "/v1/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        started.set()
                    if leave.is_set():
                        return

        with cf.ThreadPoolExecutor(2) as pool:
            left = pool.submit(background)
            assert started.wait(60)
            urgent = pool.submit(complete, engine, "urgent", max_tokens=LONG, priority=0, logit_bias=NO_EOS)
            assert wait_for(lambda: lanes(engine)["paused"] == 1, 30), lanes(engine)
            leave.set()
            left.result()
            assert urgent.result()["usage"]["completion_tokens"] == LONG

        def idle() -> bool:
            now = lanes(engine)
            return bool(now["paused"] + now["waiting"] + now["serial"] == 0 and now["kv_booked_tokens"] == 0)

        assert wait_for(idle, 30), lanes(engine)
        assert engine.stats()["requests"]["cancelled"] == cancelled + 1
        assert text_of(complete(engine, "after", max_tokens=4))  # and it serves on


def test_pauses_show_in_the_metrics_the_timeline_and_the_request_log(tiny_model: Path, tmp_path: Path) -> None:
    with serving(tiny_model, "tiny", tmp_path, model_config="batch = 1") as sup:
        started = threading.Event()

        def background() -> int:
            body = {"model": "tiny", "prompt": "background", "max_tokens": LONG, "temperature": 0,
                    "logit_bias": NO_EOS, "priority": 10}
            with sup.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                chunks = 0
                for line in resp.iter_lines():
                    chunks += line.startswith("data: {")
                    if chunks:
                        started.set()
                return chunks

        with cf.ThreadPoolExecutor(1) as pool:
            running = pool.submit(background)
            assert started.wait(60)
            urgent = sup.client.post("/v1/completions", json={"model": "tiny", "prompt": "urgent", "max_tokens": 4,
                                                              "priority": 0})
            assert urgent.status_code == 200 and running.result() > 0
        metrics = dict(line.rsplit(" ", 1) for line in sup.client.get("/metrics").text.splitlines()
                       if line.startswith("mlxd_engine_") and 'model="tiny"' in line)
        timeline = sup.client.get("/admin/timeline").json()["models"]["tiny"]
        log = sup.log()
    assert float(metrics['mlxd_engine_pauses_total{model="tiny"}']) == 1
    assert float(metrics['mlxd_engine_resumes_total{model="tiny"}']) == 1
    assert float(metrics['mlxd_engine_paused_rows{model="tiny"}']) == 0
    assert sum(timeline["paused"]) == 1 and sum(timeline["requests"]) == 2
    assert any("paused=1" in line and f"out={LONG}" in line for line in log.splitlines()), log[-2000:]
