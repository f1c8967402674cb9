"""GET /library and `mlxd models --fit` through a real supervisor: the machine's bandwidth
measured once by the real probe (a child process on real MLX) and kept in the data dir, each
model's fit from its files, and its measured decode rate once it has served."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support import SupervisorProcess, engine_env

MODEL = "tiny"


@pytest.fixture(scope="module")
def sup(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    proc = SupervisorProcess(f'[pool]\nmemory_budget_gb = 8\nprompt_cache_bytes = 1000000000\n'
                             f'[models.{MODEL}]\npath = "{tiny_model}"\n',
                             tmp_path_factory.mktemp("library") / "data").wait_up()
    yield proc
    proc.stop()


def test_the_library_measures_the_bandwidth_once_and_assesses_each_model(sup: SupervisorProcess,
                                                                         tiny_model: Path) -> None:
    first = sup.client.get("/library").json()
    machine = first["machine"]
    assert machine["device"] == "cpu" and machine["budget_bytes"] == 8 * 1024**3
    assert machine["memory_bytes"] == psutil.virtual_memory().total  # on the CPU the models live in RAM
    assert machine["bandwidth_gbs"] > 0 and "decode steps" in machine["bandwidth_probe"]
    kept = json.loads((sup.config.parent / "probe" / "bandwidth.json").read_text())
    assert kept["bandwidth_bytes_s"] / 1e9 == pytest.approx(machine["bandwidth_gbs"], abs=0.01)
    again = sup.client.get("/library").json()["machine"]
    assert again["bandwidth_measured_at"] == machine["bandwidth_measured_at"]  # kept, not measured again
    (row,) = [m for m in first["models"] if m["id"] == MODEL]
    fit = row["fit"]
    config = json.loads((tiny_model / "config.json").read_text())
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * 16 * 4  # 64 wide, 4 heads, f32
    assert fit["fits"] and fit["weights_bytes"] == row["size_bytes"]  # on disk, as the pool counts them
    assert fit["reserved_bytes"] == 10**9 and fit["kv_bytes"] % per_token == 0 and fit["context"] == 4096
    assert fit["total_bytes"] == fit["weights_bytes"] + fit["kv_bytes"] + 10**9 <= 8 * 1024**3
    assert fit["margin_bytes"] == 8 * 1024**3 - fit["total_bytes"]
    step_s = fit["bytes_per_token"] / kept["bandwidth_bytes_s"] + config["num_hidden_layers"] * kept["layer_overhead_s"]
    assert fit["predicted_decode_tps"] == pytest.approx(1 / step_s, rel=0.01)
    # A step reads every tensor (the files, less their headers) but the untied embedding table.
    table = config["vocab_size"] * config["hidden_size"] * 4
    tensors = sum(f.stat().st_size for f in tiny_model.glob("*.safetensors")) - table
    assert tensors - 4096 < fit["bytes_per_token"] - per_token * 1024 < tensors
    assert row["quantization"] == "float32" and row["state"] == "stopped" and fit["measured_decode_tps"] is None


def test_the_measured_rate_appears_once_the_model_has_served(sup: SupervisorProcess) -> None:
    sup.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=32,
                                         temperature=0, logit_bias={"0": -100})
    (row,) = [m for m in sup.client.get("/library").json()["models"] if m["id"] == MODEL]
    assert row["fit"]["measured_decode_tps"] > 0 and row["state"] == "ready"
    (engine,) = [e for e in sup.client.get("/admin/engines").json()["data"] if e["model"] == MODEL]
    assert engine["memory_estimate_bytes"] == row["fit"]["total_bytes"]  # what the pool books is the fit's total


def test_a_bad_wait_is_a_400_and_models_fit_prints_the_table(sup: SupervisorProcess) -> None:
    for bad in ("soon", "-1", "601"):
        got = sup.client.get("/library", params={"wait_s": bad})
        assert got.status_code == 400 and got.json()["error"]["param"] == "wait_s"
    out = subprocess.run([sys.executable, "-m", "mlxd", "models", "--fit", "--url", sup.url], capture_output=True,
                         text=True, env=engine_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert "GB/s (measured)" in out.stdout and "TOK/S PREDICTED" in out.stdout
    (line,) = [li for li in out.stdout.splitlines() if li.startswith(MODEL + " ")]
    assert line.split()[4] == "yes"  # FITS (after NAME, SIZE's two words, WEIGHTS)
    as_json = subprocess.run([sys.executable, "-m", "mlxd", "models", "--fit", "--json", "--url", sup.url],
                             capture_output=True, text=True, env=engine_env(), timeout=60)
    assert json.loads(as_json.stdout)["models"][0]["id"] == MODEL
