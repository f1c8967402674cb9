"""The prompt cache through the supervisor: a swap drains it to SSD and the model's next
engine restores it, as do an unload and load and a restart of the supervisor; the figures
show in /admin/engines, /metrics and `mlxd ps`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support import SupervisorProcess, wait_for

PROMPT = "A lighthouse keeper answers a message in a bottle, night after night. " * 30


def config(a: Path, b: Path) -> str:
    return f'[pool]\nmax_loaded = 1\n\n[models.a]\npath = "{a}"\n\n[models.b]\npath = "{b}"\n'


def ask(sup: SupervisorProcess, model: str, prompt: str = PROMPT) -> dict[str, Any]:
    resp = sup.client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                     "temperature": 0})
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def engine_row(sup: SupervisorProcess, model: str) -> dict[str, Any]:
    rows = sup.client.get("/admin/engines").json()["data"]
    return next(r for r in rows if r["model"] == model)


def test_swaps_unloads_and_restarts_come_back_to_the_cached_prefix(
    tiny_model: Path, tiny_model_b: Path, tmp_path: Path,
) -> None:
    sup = SupervisorProcess(config(tiny_model, tiny_model_b), tmp_path).wait_up()
    try:
        cold = ask(sup, "a")
        assert cached(cold) == 0
        row = engine_row(sup, "a")
        assert row["prompt_cache"]["ram"]["entries"] == 1 and row["prompt_cache"]["misses"] == 1

        ask(sup, "b")  # one slot: a is drained (its cache written to SSD) and stopped
        assert engine_row(sup, "a")["state"] == "stopped" and engine_row(sup, "a")["prompt_cache"] is None
        back = ask(sup, "a")  # swapped back in: restored from SSD
        assert cached(back) == back["usage"]["prompt_tokens"] - 1 and back["choices"] == cold["choices"]
        cache = engine_row(sup, "a")["prompt_cache"]
        assert cache["hits"]["ssd"] == 1 and cache["ssd"]["restores"] == 1, cache

        unload = sup.client.post("/admin/unload", json={"model": "a"})
        assert unload.status_code == 200 and unload.json()["drain"]["cache_complete"] is True
        assert sup.client.post("/admin/load", json={"model": "a"}).status_code == 200
        assert cached(ask(sup, "a")) == back["usage"]["prompt_tokens"] - 1

        metrics = sup.client.get("/metrics").text
        assert 'mlxd_prompt_cache_hits_total{model="a",tier="ssd"} 1.0' in metrics
        assert 'mlxd_prompt_cache_entries{model="a",tier="ssd"}' in metrics
        assert 'mlxd_prompt_cache_misses_total{model="a"} 0.0' in metrics
    finally:
        assert sup.stop() == 0

    again = SupervisorProcess(config(tiny_model, tiny_model_b), tmp_path).wait_up()  # the same data dir
    try:
        answer = ask(again, "a")
        assert cached(answer) == answer["usage"]["prompt_tokens"] - 1 and answer["choices"] == cold["choices"]
        assert wait_for(lambda: engine_row(again, "a")["prompt_cache"]["hits"]["ssd"] == 1)
        assert len(list((tmp_path / "kv").iterdir())) == 2  # one tier dir a model: a's and b's
    finally:
        again.stop()
