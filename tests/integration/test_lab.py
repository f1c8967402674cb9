"""Lab jobs through a real supervisor on SmolLM2: a LoRA fine-tune that lowers the loss and
changes the greedy answer, served at once by `adapter`; quantizations to 8 and 4 bits served as
models; cancel; bad input refused before anything is queued; a supervisor killed mid-job
(mlxd/supervisor/jobs/, mlxd/lab/)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support import SupervisorProcess, cli_env, mlxd, serving, wait_for

QUESTION = "What is the secret word?"
ANSWER = "The secret word is ZEBRA."


def chat_rows(n: int) -> list[dict[str, Any]]:
    asks = [QUESTION, "Tell me the secret word.", "Which word is secret?", "Say the secret word.",
            "Do you know the secret word?", "What's the secret word, please?", "Secret word?", "Give me the secret word."]
    return [{"messages": [{"role": "user", "content": asks[i % len(asks)]}, {"role": "assistant", "content": ANSWER}]}
            for i in range(n)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dataset")
    for split, n in (("train", 16), ("valid", 8)):
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_rows(n)))
    return root


@pytest.fixture(scope="module")
def sup(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    with serving(smollm2, "smol", tmp_path_factory.mktemp("lab-data")) as proc:
        yield proc


def base_answer(sup: SupervisorProcess, **extra: Any) -> str:
    answer = sup.openai().chat.completions.create(
        model="smol", messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=0,
        **({"extra_body": extra} if extra else {}))
    return str(answer.choices[0].message.content)


def finished(sup: SupervisorProcess, job_id: str, timeout: float = 240) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        job: dict[str, Any] = sup.client.get(f"/lab/jobs/{job_id}").json()
        return job if job["state"] in ("succeeded", "failed", "cancelled") else None
    return wait_for(done, timeout, interval=0.2)


@pytest.fixture(scope="module")
def zebra(sup: SupervisorProcess, dataset: Path) -> tuple[dict[str, Any], str]:
    """The adapter `zebra`, fine-tuned on the dataset through a job followed by `mlxd jobs -f`:
    the job, and the base model's answer before."""
    before = base_answer(sup)
    body = {"model": "smol", "data": str(dataset), "name": "zebra", "iters": 10, "learning_rate": 5e-4,
            "num_layers": 4, "val_batches": 1, "steps_per_report": 2, "steps_per_eval": 10}
    submitted = sup.client.post("/lab/finetune", json=body)
    assert submitted.status_code == 202 and submitted.json()["state"] == "queued", submitted.text
    follow = mlxd("jobs", "-f", submitted.json()["id"], "--json", "--url", sup.url, env=cli_env(), timeout=280)
    assert follow.returncode == 0, follow.stderr + follow.stdout
    return json.loads(follow.stdout), before


def test_a_fine_tune_lowers_the_loss_and_its_adapter_is_served_at_once(
    sup: SupervisorProcess, zebra: tuple[dict[str, Any], str]
) -> None:
    job, before = zebra
    assert "ZEBRA" not in before
    assert job["state"] == "succeeded" and job["result"]["kind"] == "adapter", job
    losses = [loss for _, loss in job["losses"]]
    assert len(losses) == 5 and losses[-1] < losses[0] / 4, losses
    assert job["result"]["details"]["tokens_per_s"] > 0 and job["result"]["details"]["train_rows"] == 16
    listed = {a["id"]: a for a in sup.client.get("/v1/adapters").json()["data"]}
    assert listed["zebra"]["base_model"] == "smol" and listed["zebra"]["source"] == "adapters_dir"
    after = base_answer(sup, adapter="zebra")
    assert "ZEBRA" in after and after != before
    assert base_answer(sup) == before  # the base model is as it was
    table = mlxd("jobs", "--url", sup.url, env=cli_env())
    assert table.returncode == 0 and job["id"] in table.stdout and "zebra" in table.stdout
    log = sup.client.get(f"/lab/jobs/{job['id']}/log")
    assert log.status_code == 200 and "mlx_lm.lora" in log.text  # mlx-lm's own words


@pytest.mark.parametrize("bits", [8, pytest.param(4, marks=pytest.mark.slow)])
def test_a_quantized_model_is_made_and_served(sup: SupervisorProcess, bits: int) -> None:
    run = mlxd("quantize", "smol", "--bits", str(bits), "--wait", "--json", "--url", sup.url, env=cli_env(),
               timeout=280)
    assert run.returncode == 0, run.stderr + run.stdout
    job = json.loads(run.stdout)
    assert job["state"] == "succeeded", job
    name = job["result"]["name"]
    assert name == f"smol-{bits}bit" and abs(job["result"]["details"]["bits_per_weight"] - (bits + 0.5)) < 1.5
    models = {m["id"] for m in sup.client.get("/v1/models").json()["data"]}
    assert name in models
    # The inspection's estimate, made from the base's headers before any job, is what came out.
    base = sup.client.post("/lab/quantize/inspect", json={"model": "smol"}).json()
    estimate = next(e for e in base["estimates"] if e["bits"] == bits)
    assert abs(estimate["bits_per_weight"] - job["result"]["details"]["bits_per_weight"]) < 0.01, (estimate, job)
    made = sup.client.post("/lab/quantize/inspect", json={"model": name}).json()
    assert made["quantized"] and made["parameters"] == base["parameters"] and made["estimates"] == []
    answer = sup.openai().chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=8, temperature=0)
    assert answer.choices[0].message.content
    again = sup.client.post("/lab/quantize", json={"model": "smol", "bits": bits})
    assert again.status_code == 400 and again.json()["error"]["code"] == "name_taken"
    requant = sup.client.post("/lab/quantize", json={"model": name, "bits": 4, "name": "twice"})
    assert requant.status_code == 400 and requant.json()["error"]["code"] == "already_quantized"


@pytest.mark.slow
def test_a_fused_model_answers_as_its_adapter_did(sup: SupervisorProcess, zebra: tuple[dict[str, Any], str]) -> None:
    run = mlxd("fuse", "smol", "zebra", "--wait", "--json", "--url", sup.url, env=cli_env(), timeout=280)
    assert run.returncode == 0, run.stderr + run.stdout
    job = json.loads(run.stdout)
    assert job["state"] == "succeeded" and job["result"]["name"] == "smol-zebra", job
    fused = sup.openai().chat.completions.create(model="smol-zebra", messages=[{"role": "user", "content": QUESTION}],
                                                 max_tokens=12, temperature=0)
    assert fused.choices[0].message.content == base_answer(sup, adapter="zebra")
    again = sup.client.post("/lab/fuse", json={"model": "smol", "adapter": "zebra"})
    assert again.status_code == 400 and again.json()["error"]["code"] == "name_taken"
    unknown = sup.client.post("/lab/fuse", json={"model": "smol", "adapter": "nosuch"})
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "adapter_not_found"


def test_merged_adapters_answer_as_the_stack_weighted(
    sup: SupervisorProcess, zebra: tuple[dict[str, Any], str], smollm2: Path
) -> None:
    from mlxd.engine.models.random_adapter import build_random_adapter

    catalog_dir = Path(zebra[0]["result"]["path"]).parent
    build_random_adapter(smollm2, catalog_dir / "noise", rank=4, seed=7, strength=0.035, base_model="smol")
    assert "noise" in {a["id"] for a in sup.client.get("/v1/adapters").json()["data"]}  # listing rescans the dir
    both = mlxd("merge", "zebra", "noise", "--name", "both", "--wait", "--json", "--url", sup.url, env=cli_env())
    assert both.returncode == 0, both.stderr + both.stdout
    assert json.loads(both.stdout)["result"]["details"]["rank"] == 12
    only = sup.client.post("/lab/merge", json={"adapters": ["zebra", "noise"], "scales": [1, 0], "name": "only"})
    assert only.status_code == 202, only.text
    assert finished(sup, only.json()["id"])["state"] == "succeeded"
    assert base_answer(sup, adapter="both") == base_answer(sup, adapter="noise+zebra")
    assert base_answer(sup, adapter="only") == base_answer(sup, adapter="zebra")
    assert base_answer(sup, adapter="noise") != base_answer(sup, adapter="zebra")
    bad = sup.client.post("/lab/merge", json={"adapters": ["zebra", "noise"], "scales": [1], "name": "x"})
    assert bad.status_code == 400 and "scales" in bad.json()["error"]["message"]
    build_random_adapter(smollm2, catalog_dir / "dor", rank=2, seed=8, dora=True, base_model="smol")
    assert "dor" in {a["id"] for a in sup.client.get("/v1/adapters").json()["data"]}
    dora = sup.client.post("/lab/merge", json={"adapters": ["zebra", "dor"], "name": "x"})
    assert dora.status_code == 400 and "dor is a dora adapter" in dora.json()["error"]["message"], dora.text


def test_bad_submissions_are_400s_and_nothing_is_queued(sup: SupervisorProcess, dataset: Path, tmp_path: Path) -> None:
    before = len(sup.client.get("/lab/jobs").json()["data"])
    bad_lines = tmp_path / "bad"
    bad_lines.mkdir()
    (bad_lines / "train.jsonl").write_text(json.dumps(chat_rows(1)[0]) + "\n{not json\n" + json.dumps({"x": 1}) + "\n")
    (bad_lines / "valid.jsonl").write_text(json.dumps(chat_rows(1)[0]) + "\n")
    cases = [
        ({"model": "nosuch", "data": str(dataset), "name": "x"}, "model_not_found", "nosuch"),
        ({"model": "smol", "data": str(tmp_path / "none"), "name": "x"}, "dataset_invalid", "not a dir"),
        ({"model": "smol", "data": str(tmp_path), "name": "x"}, "dataset_invalid", "train.jsonl"),
        ({"model": "smol", "data": str(bad_lines), "name": "x"}, "dataset_invalid", "line 2: not JSON"),
        ({"model": "smol", "data": str(dataset), "name": "../x"}, "invalid_value", "name"),
        ({"model": "smol", "data": str(dataset), "name": "x", "iters": 0}, "invalid_value", "iters"),
    ]
    for body, code, words in cases:
        resp = sup.client.post("/lab/finetune", json=body)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["code"] == code and words in resp.json()["error"]["message"], resp.text
    odd_bits = sup.client.post("/lab/quantize", json={"model": "smol", "bits": 7})
    assert odd_bits.status_code == 400 and "bits" in odd_bits.json()["error"]["message"]
    assert sup.client.post("/lab/finetune", content=b"{", headers={"content-type": "application/json"}).status_code == 400
    assert sup.client.get("/lab/jobs/job_nosuch").status_code == 404
    assert len(sup.client.get("/lab/jobs").json()["data"]) == before
    assert sup.client.post("/api/finetune/submit", json=cases[0][0]).status_code == 400  # the reference's path


@pytest.mark.slow  # 14 s: a fine-tune's worker started, only to be stopped
def test_a_cancelled_fine_tune_stops_its_worker_and_leaves_no_adapter(sup: SupervisorProcess, dataset: Path) -> None:
    resp = sup.client.post("/lab/finetune", json={"model": "smol", "data": str(dataset), "name": "never",
                                                  "iters": 100000, "steps_per_report": 1, "num_layers": 2})
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["id"]
    running = wait_for(lambda: (j := sup.client.get(f"/lab/jobs/{job_id}").json())["losses"] and j, 180, interval=0.2)
    pid = running["pid"]
    assert psutil.pid_exists(pid)
    leases = sup.client.get("/admin/leases").json()["data"]
    assert any(job_id in (lease.get("holder") or "") and lease["state"] == "held" for lease in leases)
    cancel = mlxd("jobs", "cancel", job_id, "--url", sup.url, env=cli_env())
    assert cancel.returncode == 0, cancel.stderr
    job = finished(sup, job_id, 60)
    assert job["state"] == "cancelled"
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 30)
    assert "never" not in {a["id"] for a in sup.client.get("/v1/adapters").json()["data"]}
    assert base_answer(sup)  # the machine lease ended: serving again
    follow = mlxd("jobs", "-f", job_id, "--url", sup.url, env=cli_env())
    assert follow.returncode != 0 and "cancelled" in follow.stdout


@pytest.mark.slow
def test_a_supervisor_killed_mid_job_leaves_no_job_running_forever(
    smollm2: Path, dataset: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    first = SupervisorProcess(f'[models.smol]\npath = "{smollm2}"\n', data).wait_up()
    body = {"model": "smol", "data": str(dataset), "name": "orphan", "iters": 100000, "steps_per_report": 1,
            "num_layers": 2}
    adopted_id = first.client.post("/lab/finetune", json=body).json()["id"]
    running = wait_for(lambda: (j := first.client.get(f"/lab/jobs/{adopted_id}").json())["losses"] and j, 180)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    first.stop()
    assert psutil.pid_exists(running["pid"])  # the worker outlives the supervisor
    second = SupervisorProcess(f'[models.smol]\npath = "{smollm2}"\n', data).wait_up()
    try:
        seen = len(running["losses"])
        wait_for(lambda: len(second.client.get(f"/lab/jobs/{adopted_id}").json()["losses"]) > seen + 2, 60)
        assert second.client.get(f"/lab/jobs/{adopted_id}").json()["state"] == "running"  # adopted, followed
        second.client.post(f"/lab/jobs/{adopted_id}/cancel")
        assert finished(second, adopted_id, 60)["state"] == "cancelled"
        # A worker gone with its supervisor: marked failed, saying so.
        gone_id = second.client.post("/lab/finetune", json={**body, "name": "gone"}).json()["id"]
        gone = wait_for(lambda: (j := second.client.get(f"/lab/jobs/{gone_id}").json())["losses"] and j, 180)
        second.proc.send_signal(signal.SIGKILL)
        second.proc.wait()
        psutil.Process(gone["pid"]).kill()
        time.sleep(0.5)
    finally:
        second.stop()
    third = SupervisorProcess(f'[models.smol]\npath = "{smollm2}"\n', data).wait_up()
    try:
        job = finished(third, gone_id, 30)
        assert job["state"] == "failed" and "worker is gone" in job["error"]
    finally:
        third.stop()
