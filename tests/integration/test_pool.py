"""The model pool with real supervisors and real engines: swaps, drain, unload, leases, TTL."""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support import (
    HARDENED_CONFIG,
    NO_EOS,
    SupervisorProcess,
    fake_supervisor,
    httpx,
    serving,
    wait_for,
)

LONG_STREAM = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "logit_bias": {"2": -100}}


def two_models(a: Path, b: Path, pool: str = "max_loaded = 1") -> str:
    return f'[pool]\n{pool}\n\n[models.a]\npath = "{a}"\n\n[models.b]\npath = "{b}"\n'


@pytest.fixture
def swapping(tiny_model: Path, tiny_model_b: Path, tmp_path: Path) -> Iterator[SupervisorProcess]:
    sup = SupervisorProcess(two_models(tiny_model, tiny_model_b), tmp_path, env={"MLXD_SPARE_ENGINE": "1"}).wait_up()
    yield sup
    sup.stop()


@pytest.fixture(scope="module")
def one_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    with serving(tiny_model, "a", tmp_path_factory.mktemp("one")) as sup:
        yield sup


def complete(sup: SupervisorProcess, model: str, max_tokens: int = 3, **headers: str) -> httpx.Response:
    return sup.client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": max_tokens},
                           headers=headers)


def engines(sup: SupervisorProcess) -> dict[str, dict]:
    body = sup.client.get("/admin/engines").json()
    return {e["model"]: e for e in body["data"]} | {"_": body}


def test_alternating_models_with_one_slot_all_succeed_and_swap_in_batches(swapping: SupervisorProcess) -> None:
    sup = swapping
    # The spare engine process is made once the pool has been quiet a moment.
    assert wait_for(lambda: engines(sup)["_"]["spare"]["warm"], 60), engines(sup)["_"]
    order = ["a", "b"] * 12  # 24 requests, 8 at a time: the queue holds runs of each model

    def ask(model: str) -> int:
        return complete(sup, model).status_code

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(ask, order))
    assert statuses == [200] * len(order)
    info = engines(sup)
    live = [m for m in ("a", "b") if info[m]["state"] != "stopped"]
    assert len(live) == 1, info  # never both at once
    swaps = info["_"]["evictions"]
    assert 1 <= swaps < len(order) - 1, f"{swaps} swaps for {len(order)} alternating requests"
    assert "making room for" in sup.log()
    assert "starting (from the spare)" in sup.log()  # swaps take the pre-started engine process


def test_a_busy_engine_is_not_evicted_mid_stream(swapping: SupervisorProcess) -> None:
    sup = swapping
    chunks: list[str] = []

    def stream_a() -> None:
        with sup.client.stream("POST", "/v1/completions", json={"model": "a", **LONG_STREAM}) as resp:
            chunks.extend(line for line in resp.iter_lines() if line.startswith("data: "))

    reader = threading.Thread(target=stream_a)
    reader.start()
    assert wait_for(lambda: engines(sup).get("a", {}).get("in_flight") == 1, 60, interval=0.05)
    assert complete(sup, "b").status_code == 200  # waits for a's stream, then swaps
    reader.join(60)
    assert chunks[-1] == "data: [DONE]" and len(chunks) > 100
    assert not any('"error"' in c for c in chunks)


def test_drain_lets_streams_finish_and_nothing_reaches_the_draining_engine(tiny_model: Path, tmp_path: Path) -> None:
    with serving(tiny_model, "a", tmp_path) as sup:
        assert complete(sup, "a").status_code == 200
        results: list[list[str]] = []

        def stream() -> None:
            with sup.client.stream("POST", "/v1/completions", json={"model": "a", **LONG_STREAM}) as resp:
                results.append([line for line in resp.iter_lines() if line.startswith("data: ")])

        readers = [threading.Thread(target=stream) for _ in range(2)]
        for r in readers:
            r.start()
        assert wait_for(lambda: sup.engine_stats("a")["admission"]["in_flight"] == 2, 30)  # both at the engine
        during: list[int] = []
        extra = threading.Thread(target=lambda: during.append(complete(sup, "a").status_code))
        drained = sup.client.post("/admin/drain", json={"model": "a"})
        extra.start()
        for r in readers:
            r.join(60)
        extra.join(60)
        assert drained.status_code == 200
        report = drained.json()["drained"]
        assert report[0]["model"] == "a" and report[0]["cancelled"] == 0
        assert all(lines[-1] == "data: [DONE]" for lines in results) and len(results) == 2
        assert during == [200]  # queued during the drain, served after it
        stats = sup.engine_stats("a")
        assert stats["admission"]["rejected_draining"] == 0, "the supervisor sent work to a draining engine"
        assert engines(sup)["a"]["state"] == "ready"


def test_unload_of_a_pinned_model_is_refused_unless_forced(tiny_model: Path, tmp_path: Path) -> None:
    with serving(tiny_model, "a", tmp_path) as sup:
        loaded = sup.client.post("/admin/load", json={"model": "a", "pin": True})
        assert loaded.status_code == 200 and loaded.json()["pinned"] is True
        refused = sup.client.post("/admin/unload", json={"model": "a"})
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_pinned"
        assert engines(sup)["a"]["state"] == "ready"
        forced = sup.client.post("/admin/unload", json={"model": "a", "force": True})
        assert forced.status_code == 200 and forced.json()["was_loaded"] is True
        assert forced.json()["state"] == "stopped" and forced.json()["drain"]["drained"] is True
        assert engines(sup)["a"]["state"] == "stopped"


def test_lease_blocks_others_and_ends_on_delete_and_on_expiry(tiny_model: Path, tmp_path: Path) -> None:
    with serving(tiny_model, "a", tmp_path) as sup:
        lease = sup.client.post("/admin/leases", json={"model": "a", "ttl_s": 60, "holder": "bench"}).json()
        assert lease["state"] == "held" and lease["model"] == "a"
        assert complete(sup, "a", **{"X-MLXD-Lease": lease["id"]}).status_code == 200  # the holder runs
        blocked: list[int] = []
        waiter = threading.Thread(target=lambda: blocked.append(complete(sup, "a").status_code))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive(), "a request ran while the model was leased"
        assert sup.client.delete(f"/admin/leases/{lease['id']}").json() == {"id": lease["id"], "deleted": True}
        waiter.join(30)
        assert blocked == [200]
        listed = {x["id"]: x for x in sup.client.get("/admin/leases").json()["data"]}
        assert listed[lease["id"]]["state"] == "ended" and listed[lease["id"]]["ended_reason"] == "released"

        short = sup.client.post("/admin/leases", json={"model": "a", "ttl_s": 1}).json()
        started = time.monotonic()
        assert complete(sup, "a").status_code == 200  # waits out the lease
        assert time.monotonic() - started >= 0.5
        listed = {x["id"]: x for x in sup.client.get("/admin/leases").json()["data"]}
        assert listed[short["id"]]["ended_reason"] == "expired"
        assert sup.client.delete(f"/admin/leases/{short['id']}").status_code == 404


def test_engine_crash_ends_its_lease(tiny_model: Path, tmp_path: Path) -> None:
    with serving(tiny_model, "a", tmp_path) as sup:
        lease = sup.client.post("/admin/leases", json={"model": "a", "ttl_s": 60}).json()
        psutil.Process(engines(sup)["a"]["pid"]).kill()

        def record() -> dict:
            return next(x for x in sup.client.get("/admin/leases").json()["data"] if x["id"] == lease["id"])

        assert wait_for(lambda: record()["state"] == "ended", 10, interval=0.1), record()
        assert record()["ended_reason"] == "engine_crashed"
        assert complete(sup, "a").status_code == 200  # a fresh engine serves again


def test_machine_lease_stops_every_engine_and_blocks_loads(tiny_model: Path, tiny_model_b: Path, tmp_path: Path) -> None:
    sup = SupervisorProcess(two_models(tiny_model, tiny_model_b, pool=""), tmp_path,
                            env={"MLXD_SPARE_ENGINE": "1"}).wait_up()
    try:
        assert complete(sup, "a").status_code == 200 and complete(sup, "b").status_code == 200
        pids = [engines(sup)[m]["pid"] for m in ("a", "b")]
        lease = sup.client.post("/admin/leases", json={"model": None, "ttl_s": 60, "holder": "finetune"})
        assert lease.status_code == 200 and lease.json()["model"] is None
        info = engines(sup)
        assert info["a"]["state"] == info["b"]["state"] == "stopped" and info["_"]["machine_leased"] is True
        assert info["_"]["spare"]["pid"] is None  # the job gets the machine: no spare engine either
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
        loads: list[int] = []
        loader = threading.Thread(target=lambda: loads.append(sup.client.post("/admin/load", json={"model": "a"}).status_code))
        loader.start()
        loader.join(1.0)
        assert loader.is_alive() and engines(sup)["a"]["state"] == "stopped"
        sup.client.delete(f"/admin/leases/{lease.json()['id']}")
        loader.join(60)
        assert loads == [200] and engines(sup)["a"]["state"] == "ready"
    finally:
        sup.stop()


def test_idle_ttl_zero_unloads_right_after_the_request(tiny_model: Path, tmp_path: Path) -> None:
    with serving(tiny_model, "a", tmp_path, model_config="idle_ttl_s = 0\n") as sup:
        assert complete(sup, "a").status_code == 200
        assert wait_for(lambda: engines(sup)["a"]["state"] == "stopped", 10, interval=0.05), engines(sup)["a"]
        # the pool logs it once the retire returns, a moment after the engine shows "stopped"
        assert wait_for(lambda: "unloaded (idle)" in sup.log(), 5, interval=0.05), sup.log()[-2000:]


def test_queue_timeout_and_budget_rejection(tiny_model: Path, tmp_path: Path) -> None:
    big = tmp_path / "big"  # weights past any budget: a sparse 4 TiB file (never loaded)
    big.mkdir()
    shutil.copy(tiny_model / "config.json", big / "config.json")
    with (big / "model.safetensors").open("wb") as f:
        f.truncate(4 * 1024**4)
    config = f'[pool]\nqueue_timeout_s = 0.5\n\n[models.a]\npath = "{tiny_model}"\n\n[models.big]\npath = "{big}"\n'
    sup = SupervisorProcess(config, tmp_path).wait_up()
    try:
        too_big = complete(sup, "big")
        assert too_big.status_code == 400 and too_big.json()["error"]["code"] == "model_too_large"
        assert "memory_budget_gb" in too_big.json()["error"]["message"]
        taken = sup.client.post("/admin/leases", json={"model": "a", "ttl_s": 30})
        assert taken.status_code == 200, taken.text
        lease = taken.json()
        timed_out = complete(sup, "a")
        assert timed_out.status_code == 503 and timed_out.json()["error"]["code"] == "queue_timeout"
        assert timed_out.headers["Retry-After"]
        sup.client.delete(f"/admin/leases/{lease['id']}")
    finally:
        sup.stop()


def test_a_window_no_memory_holds_is_served_with_its_kv_budget_clamped(tiny_model: Path, tmp_path: Path) -> None:
    long = tmp_path / "long"  # the tiny model with a window of 2^30 tokens, whose KV no memory holds
    long.mkdir()
    for file in tiny_model.iterdir():
        (long / file.name).symlink_to(file)
    (long / "config.json").unlink()
    (long / "config.json").write_text(json.dumps({**json.loads((tiny_model / "config.json").read_text()),
                                                  "max_position_embeddings": 2**30}))
    with serving(long, "long", tmp_path) as sup:
        assert complete(sup, "long").status_code == 200
        row = engines(sup)["long"]
        assert row["batch"] == "auto" and row["width"] >= 1
        assert "all that memory holds" in row["sizing"], row
        assert row["kv_budget_tokens"] < 2**30
        assert row["memory_estimate_bytes"] <= engines(sup)["_"]["budget_bytes"]  # booked within the budget
        metrics = dict(line.rsplit(" ", 1) for line in sup.client.get("/metrics").text.splitlines()
                       if line.startswith("mlxd_engine_") and "long" in line)
        assert float(metrics['mlxd_engine_batch_width{model="long"}']) == row["width"]
        assert float(metrics['mlxd_engine_kv_budget_tokens{model="long"}']) == row["kv_budget_tokens"]
        assert float(metrics['mlxd_engine_kv_booked_tokens{model="long"}']) == 0


@pytest.mark.parametrize(("method", "path", "body", "status"), [
    ("POST", "/admin/load", b"{", 400),
    ("POST", "/admin/load", b'{"model": 5}', 400),
    ("POST", "/admin/load", b'{"model": "nope"}', 404),
    ("POST", "/admin/unload", b'{"model": "a", "extra": 1}', 400),
    ("POST", "/admin/drain", b"[]", 400),
    ("POST", "/admin/leases", b'{"model": "a", "ttl_s": -1}', 400),
    ("POST", "/admin/leases/lease_nope/renew", b"", 404),
    ("DELETE", "/admin/leases/lease_nope", b"", 404),
])
def test_admin_bad_input_gets_openai_errors(
    one_model: SupervisorProcess, method: str, path: str, body: bytes, status: int,
) -> None:
    resp = one_model.client.request(method, path, content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == status
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_admin_routes_need_an_admin_key(tiny_model: Path, tmp_path: Path) -> None:
    config = f'[server]\napi_keys = ["user"]\nadmin_keys = ["root"]\n\n[models.a]\npath = "{tiny_model}"\n'
    sup = SupervisorProcess(config, tmp_path).wait_up()
    try:
        assert sup.client.get("/admin/engines", headers={"Authorization": "Bearer user"}).status_code == 401
        assert sup.client.get("/admin/engines", headers={"Authorization": "Bearer root"}).status_code == 200
    finally:
        sup.stop()


def test_a_lease_request_abandoned_while_waiting_holds_nothing(tiny_model: Path, tmp_path: Path) -> None:
    with serving(tiny_model, "a", tmp_path) as sup:
        streamed: list[str] = []

        def stream() -> None:
            with sup.client.stream("POST", "/v1/completions", json={"model": "a", **LONG_STREAM}) as resp:
                streamed.extend(line for line in resp.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=stream)
        reader.start()
        assert wait_for(lambda: engines(sup).get("a", {}).get("in_flight") == 1, 60)
        with pytest.raises(httpx.ReadTimeout):  # the engine's lease waits for the stream; we leave
            sup.client.post("/admin/leases", json={"model": "a", "ttl_s": 60}, timeout=0.3)
        reader.join(60)
        assert streamed[-1] == "data: [DONE]"
        assert wait_for(lambda: engines(sup)["a"]["lease"] is None, 5)
        assert all(x["state"] != "held" for x in sup.client.get("/admin/leases").json()["data"])
        assert complete(sup, "a").status_code == 200  # nobody holds the model


def test_a_spare_that_dies_is_reaped_and_replaced(tiny_model: Path, tmp_path: Path) -> None:
    def is_dead(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    with serving(tiny_model, "a", tmp_path, env={"MLXD_SPARE_ENGINE": "1"}) as sup:

        def spare() -> dict:
            return dict(engines(sup)["_"]["spare"])

        assert wait_for(lambda: spare()["warm"], 60), spare()
        first = spare()["pid"]
        psutil.Process(first).kill()
        assert wait_for(lambda: is_dead(first), 10)
        seen: list[dict] = []
        assert wait_for(lambda: seen.append(spare()) or (seen[-1]["warm"] and seen[-1]["pid"] != first), 60), seen[-1]
        assert not [s for s in seen if s["pid"] == first], "a dead spare was still shown"
        assert f"spare engine pid {first} exited with -9" in sup.log()
        assert complete(sup, "a").status_code == 200  # the new spare serves the model
        assert "starting (from the spare)" in sup.log()


def environ_of(pid: int) -> dict[str, str]:
    pairs = (item.partition("=") for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if item)
    return {name: value for name, _, value in pairs}


@pytest.mark.parametrize("spare", [True, False], ids=["from-the-spare", "spawned"])
def test_pool_cuda_graphs_reach_every_engine_process(tiny_model: Path, tmp_path: Path, spare: bool) -> None:
    # MLX reads MLX_USE_CUDA_GRAPHS once, at its first use in a process, and a spare has imported
    # MLX before it is given a model: the setting travels in every engine's environment.
    config = f'[pool]\ncuda_graphs = true\n\n[models.a]\npath = "{tiny_model}"\n'
    sup = SupervisorProcess(config, tmp_path, env={"MLXD_SPARE_ENGINE": "1" if spare else "0"}).wait_up()
    try:
        if spare:
            assert wait_for(lambda: engines(sup)["_"]["spare"]["warm"], 60), engines(sup)["_"]
            assert environ_of(engines(sup)["_"]["spare"]["pid"]).get("MLX_USE_CUDA_GRAPHS") == "1"
        assert complete(sup, "a").status_code == 200
        assert ("starting (from the spare)" in sup.log()) is spare
        assert environ_of(engines(sup)["a"]["pid"]).get("MLX_USE_CUDA_GRAPHS") == "1"
        assert "MLX settings from the environment: MLX_USE_CUDA_GRAPHS=1" in sup.log()  # the engine says so
    finally:
        sup.stop()


def test_unload_racing_requests_never_stalls_the_model(tmp_path: Path) -> None:
    """Unloads racing queued requests: each unload answers, and the model keeps serving.

    Engine.retire once waited for the *next* engine's owner task (the pool had started it for
    the queued requests), so the unload never answered and the model stayed closed for good.
    The fuzzer found it (benchmarks/fuzz.py --concurrency 4).
    """
    sup = fake_supervisor(tmp_path, config=HARDENED_CONFIG)
    stop_at = time.monotonic() + 6
    failures: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=sup.url, timeout=15) as client:
            while time.monotonic() < stop_at:
                try:
                    if rng.random() < 0.4:
                        resp = client.post("/admin/unload", json={"model": "fake"})
                    else:
                        resp = client.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2})
                except httpx.TimeoutException:
                    failures.append("timed out")
                    return
                if resp.status_code != 200:
                    failures.append(f"{resp.status_code} {resp.text[:100]}")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert failures == []
        assert sup.client.post("/v1/completions", json={"model": "fake", "prompt": "x"}, timeout=10).status_code == 200
    finally:
        sup.stop()


def test_an_engine_whose_client_left_while_it_loaded_stays_for_its_ttl(tiny_model: Path, tmp_path: Path) -> None:
    """A client that gives up while its model loads (Ctrl-C in `mlxd run`) leaves the engine loaded
    for the model's idle TTL: it was once unloaded the moment it was ready (its idle clock read 0)."""
    with serving(tiny_model, "a", tmp_path) as sup:
        with pytest.raises(httpx.TimeoutException):  # the engine takes seconds to load
            sup.client.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 3}, timeout=0.2)
        assert wait_for(lambda: engines(sup)["a"]["state"] == "ready", 60, interval=0.05), engines(sup)["a"]
        engine = engines(sup)["a"]
        assert engine["idle_ttl_s"] == 1800 and engine["expires_in_s"] > 1700, engine
        assert complete(sup, "a").status_code == 200  # and it serves the next request as it is
        assert "closing: idle" not in sup.log()


def test_a_keys_default_priority_runs_its_requests_behind_other_keys(tiny_model: Path, tmp_path: Path) -> None:
    """`[server] key_priorities`: with one row at a time, the agent's key's request (priority
    10) queued first starts after the person's (no priority: 0), and a body's own `priority`
    wins over its key's."""
    config = ('[server]\napi_keys = ["person", "agent"]\n[server.key_priorities]\nagent = 10\n\n'
              f'[models.tiny]\npath = "{tiny_model}"\nbatch = 1\n')
    sup = SupervisorProcess(config, tmp_path).wait_up()
    sup.client.headers["Authorization"] = "Bearer person"  # for /admin/engines
    finished: list[str] = []

    # Each later request decodes 48 tokens: one row at a time, their finishes lie dozens of steps
    # apart, so a client thread the busy machine schedules late cannot swap two in `finished`.
    def run(name: str, key: str, max_tokens: int = 48, **fields: Any) -> None:
        body = {"model": "tiny", "prompt": name, "max_tokens": max_tokens, "logit_bias": NO_EOS, **fields}
        answer = sup.client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 200, answer.text
        finished.append(name)

    def queued() -> int:
        """Requests the engine itself holds waiting: the supervisor counts a request in flight
        before the engine has it, and a request still on its way would be queued out of turn."""
        return int(sup.engine_stats("tiny")["lanes"]["waiting"])

    try:
        with ThreadPoolExecutor(5) as pool:
            first = pool.submit(run, "first", "person", 600)
            assert wait_for(lambda: "tiny" in engines(sup) and engines(sup)["tiny"]["state"] == "ready"
                            and sup.engine_stats("tiny")["lanes"]["serial"] == 1, 30)
            later = [pool.submit(run, "agent 1", "agent")]
            assert wait_for(lambda: queued() == 1, 10)
            later.append(pool.submit(run, "agent urgent", "agent", priority=0))  # the body's own wins
            assert wait_for(lambda: queued() == 2, 10)
            later.append(pool.submit(run, "person", "person"))
            assert wait_for(lambda: queued() == 3, 10)
            for f in [first, *later]:
                f.result()
        assert finished == ["first", "agent urgent", "person", "agent 1"]
    finally:
        sup.stop()


def test_the_pools_queue_starts_the_more_urgent_requests_model_first(tiny_model: Path, tmp_path: Path) -> None:
    """One engine at a time, held by a lease: a request for `bg` (priority 10) queued before one
    for `chat` (no priority: 0). Once the lease ends, `chat` starts and answers first."""
    config = "[pool]\nmax_loaded = 1\n\n" + "".join(f'[models.{m}]\npath = "{tiny_model}"\n\n' for m in ("a", "bg", "chat"))
    sup = SupervisorProcess(config, tmp_path).wait_up()
    finished: list[str] = []

    def run(model: str, **fields: Any) -> None:
        body = {"model": model, "prompt": "hi", "max_tokens": 4, **fields}
        answer = sup.client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        finished.append(model)

    try:
        taken = sup.client.post("/admin/leases", json={"model": "a", "ttl_s": 60})
        assert taken.status_code == 200, taken.text
        with ThreadPoolExecutor(2) as pool:
            def queued() -> int:
                return sum(e["queued"] for e in sup.client.get("/admin/engines").json()["data"])

            later = [pool.submit(run, "bg", priority=10)]
            assert wait_for(lambda: queued() == 1, 10)
            later.append(pool.submit(run, "chat"))
            assert wait_for(lambda: queued() == 2, 10)
            assert sup.client.delete(f"/admin/leases/{taken.json()['id']}").status_code == 200
            for f in later:
                f.result()
        assert finished == ["chat", "bg"]
    finally:
        sup.stop()
