"""Continuous batching in a real engine: rows join and leave between steps, each keeps its own
sampling, stops and budget, and one row's failure or departure leaves the others alone."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.protocol.exit_codes import ExitCode
from mlxd.protocol.memory import ROW_TOKENS, kv_bytes_per_token, text_config
from mlxd.protocol.sizing import AUTO_WIDTH_CAP, MIN_HEADROOM, plateau_width
from tests.support import (
    FAULTY_ENGINE,
    NO_EOS,
    EngineProcess,
    at_once,
    complete,
    engine_client,
    engine_env,
    lanes,
    running_engine,
    text_of,
    wait_for,
)


def stream_times(engine: EngineProcess, body: dict[str, Any], out: list[float], started: threading.Event | None = None) -> str:
    """Stream a completion; append each text chunk's arrival time to `out`; the text."""
    parts = []
    with engine_client(engine) as c, c.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                out.append(time.monotonic())
                parts.append(chunk["choices"][0]["text"])
                if started is not None:
                    started.set()
    return "".join(parts)


PROMPTS = [f"Story {i}: once upon a time" + " and then" * (3 * i) for i in range(8)]


@pytest.fixture(scope="module")
def batched(tiny_model: Path) -> Iterator[EngineProcess]:
    with running_engine(tiny_model, "tiny", "--batch", "8", "--prefill-step", "64") as engine:
        yield engine


def test_eight_concurrent_greedy_requests_equal_the_same_requests_one_by_one(batched: EngineProcess) -> None:
    alone = [text_of(complete(batched, p)) for p in PROMPTS]
    together = at_once(batched, [{"prompt": p} for p in PROMPTS])
    assert [a["status"] for a in together] == [200] * 8
    assert [text_of(a) for a in together] == alone


def test_smollm2_greedy_text_is_the_same_batched_as_alone(smollm2: Path) -> None:
    questions = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?", "Say hello."]
    with running_engine(smollm2, "smol", "--batch", "4") as engine:
        def ask(q: str) -> str:
            with engine_client(engine) as c:
                body = {"messages": [{"role": "user", "content": q}], "max_tokens": 24, "temperature": 0}
                return str(c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"])

        alone = [ask(q) for q in questions]
        with cf.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(ask, questions))
    assert together == alone
    assert "Paris" in alone[0]


def test_a_lone_request_runs_in_the_serial_lane_and_moves_into_the_batch_when_others_come(batched: EngineProcess) -> None:
    long = {"prompt": "The long one", "max_tokens": 1500, "logit_bias": NO_EOS}
    other = {"max_tokens": 400, "logit_bias": NO_EOS}
    alone = text_of(complete(batched, **long))
    seen: list[dict[str, Any]] = []
    with cf.ThreadPoolExecutor(4) as pool:
        first = pool.submit(complete, batched, **long)
        assert wait_for(lambda: lanes(batched)["serial"] == 1, 10)
        # Long enough that the four rows run together for seconds: a loaded machine's polls see it.
        others = [pool.submit(complete, batched, p, **other) for p in PROMPTS[:3]]
        assert wait_for(lambda: seen.append(lanes(batched)) or seen[-1]["batch"] == 4, 10), seen[-5:]
        results = [first.result(), *(f.result() for f in others)]
    assert seen[-1]["serial"] == 0  # the lone one joined the batch: one forward pass a step for all
    assert [r["status"] for r in results] == [200] * 4
    assert text_of(results[0]) == alone  # greedy: moving lanes changed no token
    assert [text_of(r) for r in results[1:]] == [text_of(complete(batched, p, **other)) for p in PROMPTS[:3]]


def test_a_seeded_request_stays_in_the_serial_lane_beside_the_batch(batched: EngineProcess) -> None:
    seeded = {"prompt": "Seeded", "max_tokens": 1500, "temperature": 1.0, "seed": 11, "logit_bias": NO_EOS}
    alone = text_of(complete(batched, **seeded))
    seen: list[dict[str, Any]] = []
    with cf.ThreadPoolExecutor(4) as pool:
        first = pool.submit(complete, batched, **seeded)
        assert wait_for(lambda: lanes(batched)["serial"] == 1, 10)
        others = [pool.submit(complete, batched, p, max_tokens=400, logit_bias=NO_EOS) for p in PROMPTS[:3]]
        assert wait_for(lambda: seen.append(lanes(batched)) or seen[-1]["batch"] >= 1, 10), seen[-5:]
        results = [first.result(), *(f.result() for f in others)]
    assert seen[-1]["serial"] == 1  # both lanes ran at once: its draws must not depend on the others
    assert [r["status"] for r in results] == [200] * 4
    assert text_of(results[0]) == alone


def test_rows_beyond_the_width_wait_in_the_engine_queue_and_all_complete(tiny_model: Path) -> None:
    with running_engine(tiny_model, "tiny", "--batch", "2") as engine:
        seen: list[dict[str, Any]] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                seen.append(lanes(engine))
                time.sleep(0.01)  # a sample every 10 ms while the rows run, not a wait

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            bodies = [{"prompt": p, "max_tokens": 300, "logit_bias": NO_EOS} for p in PROMPTS[:6]]
            results = at_once(engine, bodies)
        finally:
            stop.set()
            watcher.join()
    assert [r["status"] for r in results] == [200] * 6
    assert all(r["usage"]["completion_tokens"] == 300 for r in results)
    assert max(s["serial"] + s["batch"] for s in seen) == 2
    assert max(s["waiting"] for s in seen) >= 1


def test_a_client_that_leaves_mid_batch_frees_its_row_and_the_others_finish(batched: EngineProcess) -> None:
    cancelled_before = batched.stats()["requests"]["cancelled"]
    body = {"max_tokens": 400, "temperature": 0, "logit_bias": NO_EOS}
    with cf.ThreadPoolExecutor(4) as pool:
        stayers = [pool.submit(complete, batched, p, **body) for p in PROMPTS[:3]]

        def leave_early() -> int:
            seen = 0
            with engine_client(batched) as c, c.stream("POST", "/v1/completions", json={"prompt": PROMPTS[5], **body, "stream": True}) as resp:
                for line in resp.iter_lines():
                    seen += line.startswith("data: {")
                    if seen == 5:
                        break  # leaving the block drops the connection mid-stream
            return seen

        assert pool.submit(leave_early).result() == 5
        results = [f.result() for f in stayers]
    assert [r["usage"]["completion_tokens"] for r in results] == [400] * 3
    assert wait_for(lambda: batched.stats()["requests"]["cancelled"] == cancelled_before + 1, 5)
    assert wait_for(lambda: lanes(batched)["serial"] + lanes(batched)["batch"] == 0, 5)


def test_a_long_prompt_is_prefilled_in_chunks_while_running_streams_keep_getting_tokens(batched: EngineProcess) -> None:
    running: list[float] = []
    started = threading.Event()
    long_times: list[float] = []
    long_prompt = " ".join(f"w{i}" for i in range(800))  # thousands of tokens: dozens of 64-token chunks
    with cf.ThreadPoolExecutor(2) as pool:
        body = {"prompt": "Keep going", "max_tokens": 1200, "temperature": 0, "logit_bias": NO_EOS}
        stream = pool.submit(stream_times, batched, body, running, started)
        assert started.wait(10)
        sent = time.monotonic()
        stream_times(batched, {"prompt": long_prompt, "max_tokens": 4, "temperature": 0}, long_times)
        stream.result()
    assert long_times, "the long prompt got no tokens"
    during = [t for t in running if sent < t < long_times[0]]
    # Prefilled whole (as the serial lane does), the long prompt would leave the stream silent.
    assert len(during) >= 5, (len(during), len(running))
    assert running[-1] > long_times[0]  # and the stream was still running after it


def test_rows_keep_their_own_sampling_parameters(batched: EngineProcess) -> None:
    greedy = {"prompt": PROMPTS[1]}
    top_k_one = {"prompt": PROMPTS[1], "temperature": 1.5, "top_k": 1}  # sampling from one token is greedy
    seeded = {"prompt": PROMPTS[2], "temperature": 1.0, "seed": 7, "max_tokens": 40}
    biased = {"prompt": PROMPTS[3], "logit_bias": {"65": 100}}  # one token forced
    hot = {"prompt": PROMPTS[4], "temperature": 2.0}
    alone = {name: complete(batched, **b) for name, b in [("greedy", greedy), ("seeded", seeded)]}
    results = at_once(batched, [greedy, top_k_one, seeded, biased, hot, hot])
    assert [r["status"] for r in results] == [200] * 6
    assert text_of(results[0]) == text_of(results[1]) == text_of(alone["greedy"])
    assert text_of(results[2]) == text_of(alone["seeded"])
    forced = text_of(complete(batched, "x", max_tokens=3, logit_bias={"65": 100}))
    assert text_of(results[3]).startswith(forced)
    assert results[3]["usage"]["completion_tokens"] == 24


def test_stop_strings_end_each_row_where_its_own_stop_appears(batched: EngineProcess) -> None:
    alone = [text_of(complete(batched, p, max_tokens=40, logit_bias=NO_EOS)) for p in PROMPTS[:4]]
    stops = [text[10:14] for text in alone]  # a piece from the middle of each reply
    bodies = [{"prompt": p, "max_tokens": 40, "logit_bias": NO_EOS, "stop": [s]} for p, s in zip(PROMPTS, stops, strict=False)]
    results = at_once(batched, bodies)
    for result, text, stop in zip(results, alone, stops, strict=True):
        assert result["choices"][0]["finish_reason"] == "stop"
        assert text_of(result) == text[: text.index(stop)]


@pytest.fixture(scope="module")
def faulty(tiny_model: Path) -> Iterator[EngineProcess]:
    proc = EngineProcess(tiny_model, "tiny", "--batch", "4", launcher=FAULTY_ENGINE, env=engine_env(MLXD_BLAS="off"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_an_error_in_one_row_fails_that_request_only(faulty: EngineProcess) -> None:
    body = {"max_tokens": 200, "logit_bias": NO_EOS}
    results = at_once(faulty, [{"prompt": p, **body} for p in ["one", "two", "RAISE three", "four"]])
    assert [r["status"] for r in results] == [200, 200, 500, 200]
    assert "injected fault" in results[2]["error"]["message"]
    assert all(r["usage"]["completion_tokens"] == 200 for i, r in enumerate(results) if i != 2)


def test_an_error_in_the_batched_step_fails_its_rows_and_the_engine_serves_on(faulty: EngineProcess) -> None:
    failed_before = faulty.stats()["requests"]["failed"]
    body = {"max_tokens": 300, "logit_bias": NO_EOS}
    with cf.ThreadPoolExecutor(4) as pool:
        # Seeded, so it stays in the serial lane rather than joining the batch that fails.
        serial = pool.submit(complete, faulty, "the serial one", max_tokens=2000, seed=1, logit_bias=NO_EOS)
        assert wait_for(lambda: lanes(faulty)["serial"] == 1, 10)
        batch = [pool.submit(complete, faulty, p, **body) for p in ["BATCHFAIL a", "b", "c"]]
        batch_results = [f.result() for f in batch]
        serial_result = serial.result()
    assert serial_result["status"] == 200 and serial_result["usage"]["completion_tokens"] == 2000
    assert [r["status"] for r in batch_results] == [500, 500, 500]
    assert all("injected batch fault" in r["error"]["message"] for r in batch_results)
    assert faulty.stats()["requests"]["failed"] == failed_before + 3
    after = at_once(faulty, [{"prompt": p, "max_tokens": 20} for p in ["d", "e"]])  # a fresh batch works
    assert [r["status"] for r in after] == [200, 200]


def test_a_lost_device_ends_the_engine_and_cuts_its_rows_short(tiny_model: Path) -> None:
    """After CUDA's sticky errors nothing on the device works again in the process: the engine
    ends (its rows `engine_failed`, which the supervisor goes on from on the next engine)
    instead of failing each request from then on."""
    proc = EngineProcess(tiny_model, "tiny", "--batch", "4", launcher=FAULTY_ENGINE, env=engine_env(MLXD_BLAS="off"))
    try:
        proc.wait_ready()
        body = {"max_tokens": 300, "logit_bias": NO_EOS}
        with cf.ThreadPoolExecutor(3) as pool:
            rows = [pool.submit(complete, proc, p, **body) for p in ["DEVICELOST a", "b", "c"]]
            results = []
            for row in rows:
                try:
                    results.append(row.result()["error"]["code"])
                except httpx.TransportError:  # the process ended before its answer went out
                    results.append("gone")
        assert proc.proc.wait(30) == ExitCode.GPU_THREAD_DIED
        assert set(results) <= {"engine_failed", "gone"}, results
        assert "the device's state is lost" in proc.log()
    finally:
        proc.stop()


def test_drain_with_rows_in_flight_lets_them_finish(batched: EngineProcess) -> None:
    body = {"max_tokens": 300, "logit_bias": NO_EOS}
    with cf.ThreadPoolExecutor(5) as pool:
        rows = [pool.submit(complete, batched, p, **body) for p in PROMPTS[:4]]
        assert wait_for(lambda: batched.stats()["requests"]["active"] == 4, 10)
        drain = batched.client.post("/admin/drain", json={"timeout_s": 60, "resume": True}).json()
        results = [f.result() for f in rows]
    assert drain["finished"] == 4 and drain["cancelled"] == 0
    assert [r["usage"]["completion_tokens"] for r in results] == [300] * 4


def test_a_lease_waits_for_rows_in_flight(batched: EngineProcess) -> None:
    body = {"max_tokens": 300, "logit_bias": NO_EOS}
    with cf.ThreadPoolExecutor(5) as pool:
        rows = [pool.submit(complete, batched, p, **body) for p in PROMPTS[:3]]
        assert wait_for(lambda: batched.stats()["requests"]["active"] == 3, 10)
        with engine_client(batched) as c, c.stream("POST", "/admin/lease", json={"holder": "test"}) as lease:
            first = json.loads(next(lease.iter_lines()))
            active_when_held = batched.stats()["requests"]["active"]
        results = [f.result() for f in rows]
    assert first["status"] == "held"
    assert active_when_held == 0
    assert [r["usage"]["completion_tokens"] for r in results] == [300] * 3


def test_kv_budget_refuses_what_can_never_fit_and_queues_what_does_not_fit_now(tiny_model: Path) -> None:
    with running_engine(tiny_model, "tiny", "--batch", "4", "--kv-budget-tokens", "600") as engine:
        clamped = complete(engine, "hello", max_tokens=700, logit_bias=NO_EOS)
        assert clamped["usage"]["total_tokens"] == 600  # max_tokens clamped to what the budget leaves
        too_big = complete(engine, " ".join(["hello"] * 700), max_tokens=4)  # the prompt alone is over it
        assert too_big["status"] == 400
        assert too_big["error"]["code"] == "kv_budget_exceeded" and too_big["error"]["param"] == "messages"
        body = {"messages": [{"role": "user", "content": "hello"}], "logit_bias": NO_EOS}  # no max_tokens
        unbounded = engine.client.post("/v1/chat/completions", json=body)
        assert unbounded.status_code == 200
        assert unbounded.json()["usage"]["total_tokens"] == 600  # it ran to the end of the budget
        seen: list[dict[str, Any]] = []
        with cf.ThreadPoolExecutor(3) as pool:
            rows = [pool.submit(complete, engine, p, max_tokens=250, logit_bias=NO_EOS) for p in ["a", "b", "c"]]
            while not all(f.done() for f in rows):
                seen.append(lanes(engine))
                time.sleep(0.005)  # a sample every 5 ms until the rows end, not a wait
            results = [f.result() for f in rows]
    assert [r["usage"]["completion_tokens"] for r in results] == [250] * 3
    assert max(s["kv_booked_tokens"] for s in seen) <= 600
    assert max(s["serial"] + s["batch"] for s in seen) <= 2  # a third ~252-token row would pass 600


def test_batch_auto_takes_the_widest_batch_memory_holds(tiny_model: Path) -> None:
    per_token = kv_bytes_per_token(text_config(json.loads((tiny_model / "config.json").read_text())))
    with running_engine(tiny_model, "tiny", "--batch", "auto") as engine:  # this machine's memory: plenty
        wide = lanes(engine)
        assert "batch auto: 32 (the most on cpu)" in engine.log()
    assert (wide["width"], wide["kv_budget_tokens"]) == (AUTO_WIDTH_CAP["cpu"], AUTO_WIDTH_CAP["cpu"] * ROW_TOKENS)
    assert wide["sizing"].startswith("batch auto: 32 (the most on cpu); KV budget 131072 tokens")
    # 8 MiB past the headroom, some of it the weights': room for a few rows of 4k tokens, no more.
    memory = MIN_HEADROOM + 8 * 1024**2
    with running_engine(tiny_model, "tiny", "--batch", "auto", "--memory-bytes", str(memory),
                        "--prompt-cache-bytes", "0") as engine:
        narrow = lanes(engine)
        answers = at_once(engine, [{"prompt": p, "max_tokens": 20} for p in ["a", "b", "c"]])
        narrow_log = engine.log()
    assert 1 <= narrow["width"] < AUTO_WIDTH_CAP["cpu"]
    assert narrow["kv_budget_tokens"] * per_token <= memory - MIN_HEADROOM
    assert "as many as memory holds" in narrow["sizing"]
    # on the CPU, MLX's own small cache, not the headroom (device_memory.cache_limit_bytes)
    assert "MLX keeps at most 0.03 GiB of freed buffers for reuse (its CPU default)" in narrow_log
    assert [a["status"] for a in answers] == [200] * 3


def test_the_width_probe_narrows_auto_to_where_throughput_stops_growing(tiny_model: Path, tmp_path: Path) -> None:
    # `auto` probes on a GPU; `on` makes the CPU probe too. What it measured is in the sizing
    # line, the width is plateau_width's reading of it, and the next start reads it back.
    env = engine_env(MLXD_DATA_DIR=str(tmp_path))
    with running_engine(tiny_model, "tiny", "--batch", "auto", "--width-probe", "on", env=env) as engine:
        probed = lanes(engine)
        answers = at_once(engine, [{"prompt": p, "max_tokens": 8} for p in ["a", "b", "c"]])
    seen = re.search(r"probe [\d.]+ s, tok/s by width ([\d.:, ]+)\);", probed["sizing"])
    assert seen is not None, probed["sizing"]
    rates = {int(w): float(r) for w, r in re.findall(r"(\d+): ([\d.]+)", seen.group(1))}
    assert list(rates)[:3] == [1, 2, 4] and max(rates) <= AUTO_WIDTH_CAP["cpu"]
    assert probed["width"] == min(plateau_width(rates), AUTO_WIDTH_CAP["cpu"])
    assert probed["kv_budget_tokens"] == probed["width"] * ROW_TOKENS
    assert [a["status"] for a in answers] == [200] * 3
    assert len(list((tmp_path / "probe").glob("*.json"))) == 1
    with running_engine(tiny_model, "tiny", "--batch", "auto", "--width-probe", "on", env=env) as engine:
        again = lanes(engine)
    assert re.search(r"probe kept from [\d-]+ [\d:]+, tok/s by width", again["sizing"]), again["sizing"]
    assert again["width"] == probed["width"] and seen.group(1) in again["sizing"]
    # A configured width is never probed.
    with running_engine(tiny_model, "tiny", "--batch", "4", "--width-probe", "on") as engine:
        assert lanes(engine)["sizing"].startswith("batch 4 (configured)")
        assert "probe" not in engine.log()


def test_warmup_runs_jobs_through_the_lanes_before_ready_and_leaves_no_trace(tiny_model: Path) -> None:
    with running_engine(tiny_model, "tiny", "--batch", "4", "--warmup", "on") as engine:
        # Waves of 1, 1, then 1 + 3 joining it: the batch ran 4 rows at once.
        assert "warm-up: 6 jobs, up to 4 rows at once:" in engine.log()
        answer = complete(engine, "hello")
        assert answer["status"] == 200
        stats = engine.stats()
        assert stats["requests"]["total"] == 1  # the warm-up's own jobs are not requests
        assert stats["tokens"]["completion"] == answer["usage"]["completion_tokens"]


def test_the_step_trace_records_each_turn_with_its_lanes(tiny_model: Path, tmp_path: Path) -> None:
    trace = tmp_path / "steps.jsonl"
    engine = EngineProcess(tiny_model, "tiny", "--batch", "4", env=engine_env(MLXD_TRACE_STEPS=str(trace)))
    try:
        engine.wait_ready()
        answers = at_once(engine, [{"prompt": p, "max_tokens": 200, "logit_bias": NO_EOS} for p in ["a", "b", "c"]])
    finally:
        engine.stop()
    assert [a["status"] for a in answers] == [200] * 3
    turns = [json.loads(line) for line in trace.read_text().splitlines()]
    assert sum(t["admitted"] for t in turns) == 3
    assert all(t["ms"] >= 0 for t in turns) and [t["t"] for t in turns] == sorted(t["t"] for t in turns)
    # Each 200-token reply needs a turn per token; sent together, they overlap in the batch lane.
    assert len(turns) >= 200 and max(t["batch"] for t in turns) >= 2
    assert all(t["peak_mb"] > 0 for t in turns)  # the model's weights are held throughout
    # The batch lane's generator steps are timed within their turns, and every reply's end is on a line.
    stepped = [t for t in turns if "next_ms" in t]
    assert len(stepped) >= 190 and all(0 <= t["next_ms"] <= t["ms"] + 0.02 for t in stepped)  # (each rounded)
    assert sum(t.get("ended", 0) for t in turns) == 3


def staggered(engine: EngineProcess, prompts: list[str], gap_s: float, **body: Any) -> list[dict[str, Any]]:
    """Send one request per prompt, `gap_s` apart, each on its own thread; their answers."""
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = []
        for p in prompts:
            futures.append(pool.submit(complete, engine, p, **body))
            time.sleep(gap_s)  # on purpose: arrivals `gap_s` apart
        return [f.result() for f in futures]


def turns_of(trace: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in trace.read_text().splitlines()]


@pytest.mark.parametrize("gather_ms", [500, 0])
def test_after_a_burst_an_idle_engine_gathers_the_next_one_into_one_batched_prefill(
    tiny_model: Path, tmp_path: Path, gather_ms: int
) -> None:
    trace = tmp_path / "steps.jsonl"
    engine = EngineProcess(tiny_model, "tiny", "--batch", "4", "--gather-ms", str(gather_ms),
                           env=engine_env(MLXD_TRACE_STEPS=str(trace)))
    try:
        engine.wait_ready()
        # A lone request on a fresh engine waits for nobody: it starts alone, in the serial lane.
        assert complete(engine, "alone", max_tokens=5)["status"] == 200
        first = turns_of(trace)[0]
        assert (first["received"], first["serial"], first["batch"]) == (1, 1, 0)
        # Two at once: the engine has now seen a burst.
        assert [a["status"] for a in at_once(engine, [{"prompt": p, "max_tokens": 100, "logit_bias": NO_EOS}
                                                       for p in ["x", "y"]])] == [200, 200]
        wait_for(lambda: engine.stats()["requests"]["active"] == 0, timeout=30)
        seen = len(turns_of(trace))
        answers = staggered(engine, ["a", "b", "c"], 0.06, max_tokens=5)
    finally:
        engine.stop()
    assert [a["status"] for a in answers] == [200] * 3
    burst = next(t for t in turns_of(trace)[seen:] if t["received"])  # the turn that woke for the three
    if gather_ms:
        # All three, 60 ms apart, start in one turn, together in the batch lane.
        assert (burst["received"], burst["admitted"], burst["serial"], burst["batch"]) == (3, 3, 0, 3)
    else:
        assert (burst["received"], burst["serial"]) == (1, 1)


def test_a_more_urgent_request_starts_before_those_queued_ahead_of_it(tiny_model: Path) -> None:
    """One row at a time: behind a running row, a priority-0 request sent after two priority-10
    ones starts first, and equal priorities keep their order."""
    with running_engine(tiny_model, "tiny", "--batch", "1") as engine:
        finished: list[str] = []

        def run(name: str, **body: Any) -> None:
            assert complete(engine, name, **body)["status"] == 200
            finished.append(name)

        with cf.ThreadPoolExecutor(4) as pool:
            first = pool.submit(run, "first", max_tokens=600, logit_bias=NO_EOS)
            assert wait_for(lambda: lanes(engine)["serial"] == 1, 10)
            later = [pool.submit(run, "background 1", priority=10)]
            assert wait_for(lambda: lanes(engine)["waiting"] == 1, 10)
            later.append(pool.submit(run, "background 2", priority=10))
            assert wait_for(lambda: lanes(engine)["waiting"] == 2, 10)
            later.append(pool.submit(run, "urgent", priority=0))
            assert wait_for(lambda: lanes(engine)["waiting"] == 3, 10)
            for f in [first, *later]:
                f.result()
        assert finished == ["first", "urgent", "background 1", "background 2"]
