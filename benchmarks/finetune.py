"""A fine-tune through an mlxd job against raw mlx-lm (issue 26): training tokens/s, one run.

Both sides train the same LoRA (mlx-lm's defaults: rank 8, scale 20, the last 16 layers; batch 4)
on the same chat dataset for the same number of steps:
  * raw: mlx-lm's `train_model` (what `mlx_lm.lora --train` runs) in a worker process with the
    environment mlxd gives its workers (OpenBLAS preloaded on a Linux CPU);
  * mlxd: `POST /lab/finetune` to a supervisor at its defaults, the job followed to its end.
The figure is the job's tokens/s over raw's (each the mean of mlx-lm's own reports after the
first, which includes the warm-up), aim >= 0.95; and the job's wall time from submission to its
end over raw's (load, checks and saving included).

  python benchmarks/finetune.py --iters 40                                   # CPU, SmolLM2
  python benchmarks/finetune.py --model /tmp/models/l1b --iters 200 --rows 400   # GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
import urllib.request
from pathlib import Path
from typing import Any

from batching import bench_supervisor, default_model, log, show_log
from engine_decode import engine_env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOPICS = ["rivers", "lamps", "stones", "clouds", "fields", "glass", "ropes", "seeds", "boats", "bread"]


def make_dataset(root: Path, rows: int) -> Path:
    """Chat rows of a few dozen to a hundred tokens each (train and valid)."""
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", rows), ("valid", max(8, rows // 10))):
        with (root / f"{split}.jsonl").open("w") as f:
            for i in range(n):
                topic = TOPICS[i % len(TOPICS)]
                answer = " ".join(f"Fact {k} about {topic}: they are numbered {i * 7 + k}." for k in range(1 + i % 6))
                row = {"messages": [{"role": "user", "content": f"Tell me about {topic}, item {i}."},
                                    {"role": "assistant", "content": answer}]}
                f.write(json.dumps(row) + "\n")
    return root


def params(args: argparse.Namespace) -> dict[str, Any]:
    return {"iters": args.iters, "batch_size": 4, "learning_rate": 1e-5, "num_layers": 16, "rank": 8,
            "steps_per_report": args.report, "steps_per_eval": 10 ** 6, "val_batches": 1}


def raw_worker(job: dict[str, Any]) -> dict[str, Any]:
    from mlx_lm.lora import CONFIG_DEFAULTS, train_model
    from mlx_lm.tuner.datasets import load_local_dataset
    from mlx_lm.utils import load

    p = job["params"]
    rates: list[float] = []

    class Collect:
        def on_train_loss_report(self, info: dict[str, Any]) -> None:
            rates.append(float(info["tokens_per_second"]))

        def on_val_loss_report(self, info: dict[str, Any]) -> None:
            pass

    t0 = time.perf_counter()
    model, tokenizer = load(job["model"])[:2]
    ns = types.SimpleNamespace(**{**CONFIG_DEFAULTS, "model": job["model"], "data": job["data"], "train": True,
                                  "iters": p["iters"], "batch_size": p["batch_size"], "learning_rate": p["learning_rate"],
                                  "num_layers": p["num_layers"], "steps_per_report": p["steps_per_report"],
                                  "steps_per_eval": p["steps_per_eval"], "val_batches": p["val_batches"],
                                  "save_every": p["iters"], "adapter_path": job["out"],
                                  "lora_parameters": {"rank": p["rank"], "dropout": 0.0, "scale": 20.0}})
    train, valid, _ = load_local_dataset(Path(job["data"]), tokenizer, ns)
    train_model(ns, model, train, valid, Collect())
    return {"rates": rates, "wall_s": time.perf_counter() - t0}


def run_raw(job: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--raw-worker", json.dumps(job)], env=engine_env(),
                          stdout=subprocess.PIPE, text=True, check=True, start_new_session=True)
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def run_mlxd(args: argparse.Namespace, data: Path, work: Path) -> dict[str, Any]:
    sup, _ = bench_supervisor(args.model, work)
    try:
        sup.wait_health()
        t0 = time.perf_counter()
        body = json.dumps({"model": "bench", "data": str(data), "name": "bench-ft", **params(args)}).encode()
        post = urllib.request.Request(f"{sup.url}/lab/finetune", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(post, timeout=60) as resp:
            job_id = json.loads(resp.read())["id"]
        while True:
            with urllib.request.urlopen(f"{sup.url}/lab/jobs/{job_id}", timeout=60) as resp:
                job = json.loads(resp.read())
            if job["state"] not in ("queued", "running"):
                break
            time.sleep(0.2)
        wall = time.perf_counter() - t0
        if job["state"] != "succeeded":
            raise RuntimeError(f"the job {job['state']}: {job.get('error')}")
        events = (work / "data" / "jobs" / job_id / "events.jsonl").read_text().splitlines()
        rates = [e["tokens_per_s"] for e in map(json.loads, events) if e.get("tokens_per_s")]
        return {"rates": rates, "wall_s": wall, "job": job_id}
    except Exception:
        show_log(work / "serve.log")
        raise
    finally:
        sup.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--report", type=int, default=5, help="steps per loss report (each gives a tokens/s)")
    p.add_argument("--json", type=Path)
    p.add_argument("--raw-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.raw_worker:
        print(json.dumps(raw_worker(json.loads(args.raw_worker))))
        return
    args.model = args.model or default_model()
    with tempfile.TemporaryDirectory(prefix="mlxd-finetune-") as tmp:
        work = Path(tmp)
        data = make_dataset(work / "dataset", args.rows)
        raw = run_raw({"model": str(args.model), "data": str(data), "out": str(work / "raw-adapter"),
                       "params": params(args)})
        log(f"[raw] tokens/s by report: {[round(r) for r in raw['rates']]}, {raw['wall_s']:.1f} s")
        job = run_mlxd(args, data, work)
        log(f"[mlxd] tokens/s by report: {[round(r) for r in job['rates']]}, {job['wall_s']:.1f} s")
    figures = {"raw_tps": statistics.mean(raw["rates"][1:]), "job_tps": statistics.mean(job["rates"][1:])}
    figures["job_over_raw_tps"] = figures["job_tps"] / figures["raw_tps"]
    figures["job_over_raw_wall"] = job["wall_s"] / raw["wall_s"]
    for k, v in figures.items():
        print(f"{k}: {v:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"raw": raw, "mlxd": job, "figures": figures}, indent=2))


if __name__ == "__main__":
    main()
