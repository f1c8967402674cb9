"""The lab around jobs, through a real supervisor on SmolLM2 with an API key on: a dataset made
by a template through mlxd's own /v1, inspecting a dataset and a model, dynamic quantization to
a target bits per weight, GPTQ, AWQ and DWQ, and the Hugging Face token and a push against the stand-in hub
(mlxd/lab/, mlxd/supervisor/http/lab_data_routes.py)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from mlxd.protocol.datasets import check_dir
from tests.hub_stub import HubStub, running_hub
from tests.support import SupervisorProcess, cli_env, mlxd, serving, wait_for

KEY = "lab-data-key"
TOKEN = "hf_TestTokenThatMustNeverShow0123456789"


@pytest.fixture(scope="module")
def hub() -> Iterator[HubStub]:
    with running_hub() as stub:
        stub.token = TOKEN
        yield stub


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lab-data")


@pytest.fixture(scope="module")
def sup(smollm2: Path, data_dir: Path, hub: HubStub) -> Iterator[SupervisorProcess]:
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    env.update(MLXD_API_KEY=KEY, HF_ENDPOINT=hub.url, HF_HOME=str(data_dir / "hf-home"))
    with serving(smollm2, "smol", data_dir, env=env) as proc:
        proc.client.close()
        proc.client = httpx.Client(base_url=proc.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"})
        yield proc


def finished(sup: SupervisorProcess, job_id: str, timeout: float = 240) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        job: dict[str, Any] = sup.client.get(f"/lab/jobs/{job_id}").json()
        return job if job["state"] in ("succeeded", "failed", "cancelled") else None
    return wait_for(done, timeout, interval=0.2)


def quantized(sup: SupervisorProcess, body: dict[str, Any], path: str = "/lab/quantize") -> dict[str, Any]:
    """The quantize job `body` queued at `path`, once it succeeded."""
    submitted = sup.client.post(path, json=body)
    assert submitted.status_code == 202, submitted.text
    job = finished(sup, submitted.json()["id"], timeout=900)
    assert job["state"] == "succeeded", job
    return job


def assert_served(sup: SupervisorProcess, model: str) -> None:
    answer = sup.openai(KEY).chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=6, temperature=0)
    assert answer.choices[0].message.content


def rows_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tides(sup: SupervisorProcess) -> dict[str, Any]:
    """The dataset `tides`: 4 question-and-answer rows SmolLM2 wrote through a dataset job."""
    templates = {t["id"]: t for t in sup.client.get("/lab/dataset/templates").json()["data"]}
    assert {"qa", "instruct", "rewrite", "classify"} <= set(templates)
    body = {"template": "qa", "model": "smol", "name": "tides", "rows": 4,
            "inputs": {"topic": "ocean tides", "max_answer_chars": 120}}
    submitted = sup.client.post("/lab/dataset", json=body)
    assert submitted.status_code == 202, submitted.text
    job = finished(sup, submitted.json()["id"])
    assert job["state"] == "succeeded", job
    return job


def test_a_dataset_job_writes_the_rows_its_template_asks_for(sup: SupervisorProcess, tides: dict[str, Any]) -> None:
    made = tides["result"]
    assert made["kind"] == "dataset" and made["details"]["rows"] == {"train": 3, "valid": 1}
    path = Path(made["path"])
    reports = check_dir(path)  # what a fine-tune checks: every line a good chat row
    assert {r.split: (r.rows, r.format) for r in reports} == {"train": (3, "chat"), "valid": (1, "chat")}
    rows = rows_of(path / "train.jsonl") + rows_of(path / "valid.jsonl")
    questions = {r["messages"][0]["content"] for r in rows}
    assert len(questions) == 4  # no repeats
    for row in rows:
        user, assistant = row["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        assert user["content"].strip() and 0 < len(assistant["content"]) <= 120
    # SmolLM2 wrote them (through the engine, like any client): the engine counted the requests.
    assert sup.engine_stats("smol")["requests"]["completed"] >= 4
    listed = {d["name"]: d for d in sup.client.get("/lab/datasets").json()["data"]}
    assert listed["tides"]["rows"] == {"train": 3, "valid": 1} and listed["tides"]["format"] == "chat"
    inspected = sup.client.post("/lab/finetune/inspect", json={"data": "tides"}).json()  # by its name
    assert inspected["ok"] and [f["rows"] for f in inspected["files"]] == [3, 1]
    listed_templates = mlxd("dataset", "--templates", "--url", sup.url, env=cli_env(MLXD_API_KEY=KEY))
    assert listed_templates.returncode == 0 and "classify" in listed_templates.stdout and "labels" in listed_templates.stdout
    run = mlxd("dataset", "classify", "smol", "--name", "moods", "--rows", "2", "-i", "labels=happy, sad",
               "-i", "max_chars=80", "--wait", "--json", "--url", sup.url, env=cli_env(MLXD_API_KEY=KEY), timeout=200)
    assert run.returncode == 0, run.stderr + run.stdout
    job = json.loads(run.stdout)
    assert job["state"] == "succeeded", job
    labels = [r["messages"][2]["content"] for r in rows_of(Path(job["result"]["path"]) / "train.jsonl")
              + rows_of(Path(job["result"]["path"]) / "valid.jsonl")]
    assert sorted(labels) == ["happy", "sad"]  # the labels in turn


def test_bad_lab_requests_are_400s_naming_the_problem(sup: SupervisorProcess, smollm2: Path, data_dir: Path,
                                                      tmp_path: Path) -> None:
    before = len(sup.client.get("/lab/jobs").json()["data"])

    def refused(path: str, body: dict[str, Any], param: str | None = None) -> dict[str, Any]:
        answer = sup.client.post(path, json=body)
        assert answer.status_code == 400, (path, body, answer.text)
        error: dict[str, Any] = answer.json()["error"]
        if param:
            assert error["param"] == param, error
        return error

    base = {"template": "qa", "model": "smol", "name": "x", "inputs": {"topic": "t"}}
    assert "templates: qa" in refused("/lab/dataset", {**base, "template": "nope"}, "template")["message"]
    assert "'topic'" in refused("/lab/dataset", {**base, "inputs": {}}, "inputs")["message"]
    assert "no input 'colour'" in refused("/lab/dataset", {**base, "inputs": {"topic": "t", "colour": "red"}})["message"]
    refused("/lab/dataset", {**base, "inputs": {"topic": "t", "max_answer_chars": "many"}}, "inputs")
    refused("/lab/dataset", {**base, "model": "no-such-model"}, "model")
    refused("/lab/dataset", {**base, "rows": 1}, "rows")
    refused("/lab/dataset", {**base, "labels": ["surprise"]})
    assert sup.client.post("/lab/dataset", content=b"{nope").status_code == 400
    refused("/lab/quantize", {"model": "smol", "method": "dynamic"}, "target_bpw")
    assert "out of reach" in refused("/lab/quantize", {"model": "smol", "target_bpw": 9.0}, "target_bpw")["message"]
    refused("/lab/quantize", {"model": "smol", "target_bpw": 4.5, "recipe": "mixed_3_6"}, "recipe")
    refused("/lab/quantize", {"model": "smol", "calibration": "x"}, "calibration")
    refused("/lab/quantize", {"model": "smol", "method": "gptq", "calibration": str(tmp_path / "none")}, "calibration")
    refused("/lab/quantize", {"model": "smol", "method": "gptq", "candidate_bits": [3, 4]}, "candidate_bits")
    refused("/lab/quantize", {"model": "smol", "target_bpw": 4.5, "candidate_bits": [4, 4, 6]}, "candidate_bits")
    refused("/lab/quantize", {"model": "smol", "target_bpw": 4.5, "candidate_bits": [3, 6], "high_bits": 8}, "high_bits")
    refused("/lab/quantize", {"model": "smol", "target_bpw": 4.5, "candidate_bits": [7, 8]}, "candidate_bits[0]")
    assert "out of reach" in refused("/lab/quantize", {"model": "smol", "target_bpw": 6.5, "candidate_bits": [3, 4]},
                                     "target_bpw")["message"]
    assert "reference" in refused("/api/quantize/submit", {"model_id": "smol", "target_bpw": 4.5,
                                                           "reference": "x"})["message"]
    listed = mlxd("quantize", "smol", "--target-bpw", "4.5", "--candidate-bits", "3,x", "--url", sup.url,
                  env=cli_env(MLXD_API_KEY=KEY))
    assert listed.returncode == 2 and "comma-separated" in listed.stderr
    two = mlxd("quantize", "smol", "--gptq", "--method", "awq", "--url", sup.url, env=cli_env(MLXD_API_KEY=KEY))
    assert two.returncode == 2 and "two methods" in two.stderr
    assert "below 8 bits" in refused("/lab/quantize", {"model": "smol", "method": "dwq", "bits": 8}, "bits")["message"]
    refused("/lab/quantize", {"model": "smol", "learning_rate": 1e-5}, "learning_rate")  # DWQ's only
    refused("/lab/quantize", {"model": "smol", "method": "dwq", "learning_rate": 0}, "learning_rate")
    refused("/lab/quantize", {"model": "smol", "method": "awq", "target_bpw": 4.5}, "target_bpw")
    # A model type mlx-lm's AWQ has no recipe for: refused before a job, naming the ones it has.
    odd = data_dir / "models" / "odd-arch"
    odd.mkdir(parents=True)
    for f in smollm2.iterdir():
        if f.name != "config.json":
            (odd / f.name).symlink_to(f)
    (odd / "config.json").write_text(json.dumps({**json.loads((smollm2 / "config.json").read_text()),
                                                 "model_type": "phi3"}))
    wait_for(lambda: "odd-arch" in {m["id"] for m in sup.client.get("/v1/models").json()["data"]}, 10)
    error = refused("/lab/quantize", {"model": "odd-arch", "method": "awq"}, "method")
    assert error["code"] == "method_unsupported" and "(phi3)" in error["message"] and "llama" in error["message"]
    refused("/lab/quantize/inspect", {"model": "no-such-model"}, "model")
    refused("/lab/quantize/inspect", {"model": "smol", "group_size": 48}, "group_size")
    refused("/lab/finetune/inspect", {}, "data")
    cli = mlxd("dataset", "nope", "smol", "--name", "x", "--url", sup.url, env=cli_env(MLXD_API_KEY=KEY))
    assert cli.returncode == 1 and "Unknown template 'nope'" in cli.stderr
    cli = mlxd("dataset", "qa", "smol", "--name", "x", "-i", "topic", "--url", sup.url, env=cli_env(MLXD_API_KEY=KEY))
    assert cli.returncode == 2 and "KEY=VALUE" in cli.stderr
    # The reference's field names on its /api paths: each error names mlxd's field, so the name was read.
    assert "no-such" in refused("/api/quantize/submit", {"model_id": "no-such"}, "model")["message"]
    assert "/nowhere" in refused("/api/finetune/submit", {"model_dir": "smol", "data_dir": "/nowhere",
                                                         "adapter_path": "/x/ada"}, "data")["message"]
    assert refused("/api/finetune/merge", {"adapter_a": "gone-a", "adapter_b": "gone-b"},
                   "adapter")["message"] == "Adapter 'gone-a' not found."
    assert refused("/api/finetune/export", {"base_model": "smol", "adapter_path": "/some/dir/gone-c"},
                   "adapter")["message"] == "Adapter 'gone-c' not found."
    assert len(sup.client.get("/lab/jobs").json()["data"]) == before  # nothing was queued
    # An inspection of a dataset that cannot be trained on says why, line by line.
    (tmp_path / "train.jsonl").write_text('{"text": "fine"}\nnot json\n{"prompt": "p", "completion": "c"}\n')
    inspected = sup.client.post("/api/finetune/inspect-dataset", json={"path": str(tmp_path)}).json()
    assert not inspected["ok"] and "valid.jsonl" in inspected["error"]
    (tmp_path / "valid.jsonl").write_text('{"text": "fine"}\n')
    inspected = sup.client.post("/lab/finetune/inspect", json={"data": str(tmp_path)}).json()
    train = inspected["files"][0]
    assert not inspected["ok"] and train["rows"] == 1 and [b["line"] for b in train["bad"]] == [2, 3]


def test_a_model_inspection_matches_what_mlx_counts(sup: SupervisorProcess, smollm2: Path) -> None:
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import compute_bits_per_weight, load_model

    found = sup.client.post("/api/quantize/inspect", json={"model_id": "smol"}).json()
    model, _ = load_model(smollm2, lazy=True)
    assert found["parameters"] == sum(v.size for _, v in tree_flatten(model.parameters()))
    assert not found["quantized"] and found["model_type"] == "llama" and found["layers"] == 30
    nn.quantize(model, group_size=64, bits=4)
    four = next(e for e in found["estimates"] if e["bits"] == 4)
    assert abs(four["bits_per_weight"] - compute_bits_per_weight(model)) < 0.01, four


@pytest.mark.slow  # a minute of CPU: mlx-lm's threshold search quantizes the model ~10 times
def test_dynamic_quantization_reaches_its_target_and_is_served(sup: SupervisorProcess, tmp_path: Path) -> None:
    estimates = {e["bits"]: e["bits_per_weight"] for e in
                 sup.client.post("/lab/quantize/inspect", json={"model": "smol"}).json()["estimates"]}
    target = round((estimates[4] + estimates[5]) / 2, 2)  # halfway between all at 4 bits and all at 5
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(f"The tide at harbour {i} rose {i % 7} feet before noon." for i in range(200)))
    run = mlxd("quantize", "smol", "--bits", "4", "--target-bpw", str(target), "--calibration", str(text), "--wait",
               "--json", "--url", sup.url, env=cli_env(MLXD_API_KEY=KEY), timeout=280)
    assert run.returncode == 0, run.stderr + run.stdout
    job = json.loads(run.stdout)
    details = job["result"]["details"]
    assert job["result"]["name"] == f"smol-{target:g}bpw" and details["method"] == "dynamic"
    assert target - 0.25 < details["bits_per_weight"] <= target + 0.02, (target, details)
    config = json.loads((Path(job["result"]["path"]) / "config.json").read_text())["quantization"]
    per_layer = {v["bits"] for v in config.values() if isinstance(v, dict)}
    assert per_layer == {5}, config  # the sensitive layers named, at the high bits
    assert_served(sup, f"smol-{target:g}bpw")


@pytest.mark.slow  # a sensitivity pass a width below the highest, on the CPU (about a minute)
def test_several_candidate_widths_are_shared_out_to_the_target(sup: SupervisorProcess, tmp_path: Path) -> None:
    estimates = {e["bits"]: e["bits_per_weight"] for e in
                 sup.client.post("/lab/quantize/inspect", json={"model": "smol"}).json()["estimates"]}
    target = round((estimates[4] + estimates[6]) / 2, 2)
    # The reference's request on its path: model_id, n_calibration, candidate_bits, target_bpw.
    body = {"model_id": "smol", "target_bpw": target, "candidate_bits": [3, 4, 6], "n_calibration": 8,
            "calibration": str(calibration_file(tmp_path)), "calibration_length": 32}
    job = quantized(sup, body, "/api/quantize/submit")
    details = job["result"]["details"]
    assert target - 0.05 < details["bits_per_weight"] <= target + 0.005, (target, details)
    config = json.loads((Path(job["result"]["path"]) / "config.json").read_text())["quantization"]
    widths = [v["bits"] for v in config.values() if isinstance(v, dict)]
    assert set(widths) <= {3, 4, 6} and len(set(widths)) >= 2, config  # a mix, of the candidates only
    assert {int(k): n for k, n in details["layers_by_bits"].items() if n} == \
        {b: widths.count(b) for b in set(widths)}
    assert_served(sup, job["result"]["name"])


def test_the_token_is_kept_private_and_a_push_reaches_the_hub(
    sup: SupervisorProcess, hub: HubStub, data_dir: Path, tides: dict[str, Any], smollm2: Path
) -> None:
    from mlxd.engine.models.random_adapter import build_random_adapter

    assert sup.client.get("/lab/settings/hf-token").json() == {"has_token": False, "source": None}
    missing = sup.client.post("/lab/push", json={"kind": "dataset", "name": "tides", "repo_id": "me/tides"})
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "hf_token_missing"
    login = mlxd("login", "--data-dir", str(data_dir), env=cli_env(), input_text=TOKEN + "\n")
    assert login.returncode == 0 and TOKEN not in login.stdout + login.stderr, login.stderr
    token_file = data_dir / "hf_token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and token_file.read_text().strip() == TOKEN
    assert sup.client.get("/lab/settings/hf-token").json() == {"has_token": True, "source": "file"}

    build_random_adapter(smollm2, data_dir / "adapters" / "noisy", rank=2, seed=3, base_model="smol")
    jobs = []
    for body in ({"kind": "adapter", "name": "noisy", "repo_id": "me/noisy", "private": True},
                 {"kind": "dataset", "name": "tides", "repo_id": "me/tides"}):
        submitted = sup.client.post("/lab/push", json=body)
        assert submitted.status_code == 202, submitted.text
        jobs.append(finished(sup, submitted.json()["id"]))
    assert [j["state"] for j in jobs] == ["succeeded", "succeeded"], jobs
    adapter_dir = data_dir / "adapters" / "noisy"
    assert hub.pushed["model:me/noisy"] == {f.name: f.read_bytes() for f in adapter_dir.iterdir() if f.is_file()}
    assert set(hub.pushed["dataset:me/tides"]) == {"train.jsonl", "valid.jsonl"}
    assert {c["visibility"] if "visibility" in c else c.get("private") for c in hub.created} >= {"private"}
    assert set(hub.auth_seen) == {f"Bearer {TOKEN}"}
    # Never shown: not in a job, its files or log, the supervisor's log, or the token route.
    for job in jobs:
        job_dir = data_dir / "jobs" / job["id"]
        seen = json.dumps(job) + "".join(f.read_text(errors="replace") for f in job_dir.rglob("*") if f.is_file())
        assert TOKEN not in seen and "hf_Test" not in seen
    assert TOKEN not in sup.log()

    # A token the hub refuses fails the push, saying why; the reference's alias pushes a job's dataset.
    sup.client.post("/lab/settings/hf-token", json={"token": "hf_wrong"})
    refused = finished(sup, sup.client.post("/api/dataset/push", json={"job_id": tides["id"], "repo_id": "me/tides2"})
                       .json()["id"])
    assert refused["state"] == "failed" and "refused the token" in refused["error"], refused
    assert sup.client.delete("/lab/settings/hf-token").json()["has_token"] is False
    assert not token_file.exists()
    login = mlxd("login", "--data-dir", str(data_dir), env=cli_env(), input_text="not a token\n")
    assert login.returncode == 1 and "one word" in login.stderr and not token_file.exists()
    mlxd("login", "--data-dir", str(data_dir), env=cli_env(), input_text=TOKEN + "\n")
    logout = mlxd("logout", "--data-dir", str(data_dir), env=cli_env())
    assert logout.returncode == 0 and "removed" in logout.stdout and not token_file.exists()
    nothing = mlxd("push", "adapter", "nosuch", "me/x", "--url", sup.url, env=cli_env(MLXD_API_KEY=KEY))
    assert nothing.returncode == 1 and "No Hugging Face token" in nothing.stderr  # said before any lookup
    bad = sup.client.post("/lab/settings/hf-token", json={"token": "two words"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "token"


@pytest.mark.slow  # GPTQ evaluates each column of each layer on the CPU
def test_gptq_quantization_is_made_from_calibration_text_and_served(sup: SupervisorProcess, data_dir: Path,
                                                                   tmp_path: Path) -> None:
    text = tmp_path / "calibration.jsonl"  # a JSON-lines file: the text of its rows
    text.write_text("".join(json.dumps({"text": f"The tide at harbour {i} rose {i % 7} feet before noon."}) + "\n"
                            for i in range(120)))
    body = {"model": "smol", "bits": 4, "method": "gptq", "calibration": str(text), "calibration_samples": 4,
            "calibration_length": 64}
    job = quantized(sup, body)
    assert job["result"]["name"] == "smol-gptq-4bit" and job["result"]["details"]["method"] == "gptq"
    events = (data_dir / "jobs" / job["id"] / "events.jsonl").read_text()
    assert "4 calibration samples of 64 tokens" in events  # drawn from the file's rows
    assert_served(sup, "smol-gptq-4bit")


def calibration_file(tmp_path: Path) -> Path:
    text = tmp_path / "calibration.jsonl"
    text.write_text("".join(json.dumps({"text": f"The tide at harbour {i} rose {i % 7} feet before noon, and the "
                                                f"boats of the {i}th fleet waited."}) + "\n" for i in range(200)))
    return text


def mean_kl(model: Any, full: Any, tokens: Any) -> float:
    """The mean KL divergence per token of `model`'s next-token distribution from `full`'s."""
    import mlx.core as mx
    from mlx_lm.tuner.losses import kl_div_loss

    return float(kl_div_loss(model(tokens).astype(mx.float32), full(tokens).astype(mx.float32)).mean().item())


@pytest.mark.slow  # AWQ searches each block's scales on the CPU (about 2 minutes)
def test_awq_quantization_brings_the_model_nearer_the_full_one_than_rounding(
        sup: SupervisorProcess, smollm2: Path, data_dir: Path, tmp_path: Path) -> None:
    import copy

    import mlx.core as mx
    from mlx_lm.utils import load, quantize_model

    text = calibration_file(tmp_path)
    body = {"model": "smol", "bits": 4, "method": "awq", "calibration": str(text), "calibration_samples": 8,
            "calibration_length": 24}
    job = quantized(sup, body)
    made = job["result"]
    assert made["name"] == "smol-awq-4bit" and made["details"]["method"] == "awq"
    events = [json.loads(line) for line in (data_dir / "jobs" / job["id"] / "events.jsonl").read_text().splitlines()]
    blocks = [(e["step"], e["total"]) for e in events if e.get("stage") == "quantizing" and "step" in e]
    assert blocks == [(i, 30) for i in range(1, 31)]  # a step a block of SmolLM2's 30
    quantization = json.loads((Path(made["path"]) / "config.json").read_text())["quantization"]
    assert quantization["model.layers.0.mlp.down_proj"] == {"group_size": 64, "bits": 4}
    # Nearer the full model than every layer rounded to nearest at the same bits, on text like
    # the calibration's (rows it was not calibrated on).
    full, tokenizer, config = load(str(smollm2), return_config=True)
    rounded, _ = quantize_model(copy.deepcopy(full), config, group_size=64, bits=4)
    awq, _ = load(made["path"])
    tokens = mx.array([tokenizer.encode(f"The tide at harbour {i} rose {i % 7} feet before noon.")[:14]
                       for i in (501, 777)])
    assert mean_kl(awq, full, tokens) < mean_kl(rounded, full, tokens)
    assert_served(sup, "smol-awq-4bit")


@pytest.mark.slow  # DWQ trains through quantized layers, whose matmuls are slow on MLX's CPU
def test_dwq_trains_the_quantized_model_towards_the_full_one(sup: SupervisorProcess, data_dir: Path,
                                                             tmp_path: Path) -> None:
    cli = mlxd("quantize", "smol", "--method", "dwq", "--calibration", str(calibration_file(tmp_path)),
               "--calibration-samples", "8", "--calibration-length", "24", "--learning-rate", "1e-5",
               "--name", "smol-dwq", "--json", "--url", sup.url, env=cli_env(MLXD_API_KEY=KEY))
    assert cli.returncode == 0, cli.stderr
    job = finished(sup, json.loads(cli.stdout)["id"], timeout=900)
    assert job["state"] == "succeeded", job
    details = job["result"]["details"]
    assert details["method"] == "dwq" and details["learning_rate"] == 1e-5
    assert details["kl_after"] < details["kl_before"]  # measured on 4 held-out rows
    events = [json.loads(line) for line in (data_dir / "jobs" / job["id"] / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e.get("stage") == "training"]
    assert steps[0]["total"] == 2 and steps[-1]["step"] == 2 and steps[-1]["val_loss"] == details["kl_after"]
    assert_served(sup, "smol-dwq")
