"""`mlxd finetune`, `mlxd quantize`, `mlxd jobs`: the lab's jobs from the shell (/lab routes).

`--wait` follows the job's stream, drawing its progress on one line of a terminal (a line per
report otherwise), and exits non-zero when the job fails or is cancelled.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import click

from mlxd.cli.admin.client import AdminClient
from mlxd.cli.admin.cmds import daemon_options, emit, failures_as_click, json_option, make_client
from mlxd.cli.admin.tables import render_table

EXIT_JOB_FAILED = 1


def progress_text(job: Mapping[str, Any]) -> str:
    """One line for a job's progress: state, stage, step/total, loss, tokens/s, ETA."""
    p = job.get("progress") or {}
    parts = [job["state"]]
    if p.get("stage"):
        parts.append(p["stage"])
    if p.get("step") is not None and p.get("total"):
        parts.append(f"step {p['step']}/{p['total']}")
    if p.get("loss") is not None:
        parts.append(f"loss {p['loss']:.3f}")
    if p.get("val_loss") is not None:
        parts.append(f"val {p['val_loss']:.3f}")
    if p.get("tokens_per_s"):
        parts.append(f"{p['tokens_per_s']:.0f} tok/s")
    if p.get("eta_s") is not None and job["state"] == "running":
        parts.append(f"ETA {p['eta_s']:.0f} s")
    if p.get("message") and not p.get("step"):
        parts.append(p["message"])
    return " · ".join(parts)


def job_text(job: Mapping[str, Any]) -> str:
    lines = [f"{job['id']}  {job['kind']}  {progress_text(job)}"]
    if job.get("error"):
        lines.append(f"error: {job['error']}")
    if result := job.get("result"):
        lines.append(f"made: {result['kind']} {result['name']} at {result['path']}")
    if job.get("log_path"):
        lines.append(f"log: {job['log_path']}")
    return "\n".join(lines)


def jobs_text(listing: Mapping[str, Any]) -> str:
    rows = []
    for j in listing.get("data", []):
        made = (j.get("result") or {}).get("name") or "-"
        progress = progress_text(j).removeprefix(j["state"]).strip(" ·") or "-"
        if j["state"] == "failed" and j.get("error"):  # why, rather than where it was
            progress = j["error"] if len(j["error"]) <= 100 else j["error"][:99] + "…"
        rows.append((j["id"], j["kind"], j["state"], time.strftime("%Y-%m-%d %H:%M", time.localtime(j["created_at"])),
                     progress, made))
    if not rows:
        return "no jobs yet (`mlxd finetune`, `mlxd quantize`)"
    return render_table(("JOB", "KIND", "STATE", "CREATED", "PROGRESS", "MADE"), rows)


def follow(client: AdminClient, job_id: str, as_json: bool) -> dict[str, Any]:
    """Draw the job's progress until it ends; its last state."""
    last: dict[str, Any] = {}
    live = sys.stderr.isatty() and not as_json
    for job in client.events(f"/lab/jobs/{quote(job_id, safe='')}/stream"):
        last = job
        if as_json:
            continue
        line = progress_text(job)
        if live:
            click.echo(f"\r\033[K{line}", nl=False, err=True)
        else:
            click.echo(line, err=True)
    if live:
        click.echo("", err=True)
    return last


def submitted(client: AdminClient, job: dict[str, Any], wait: bool, as_json: bool) -> None:
    if not wait:
        emit(job, as_json, lambda j: f"job {j['id']} queued (follow it: mlxd jobs -f {j['id']})")
        return
    if not as_json:
        click.echo(f"job {job['id']} ({job['kind']}) queued", err=True)
    final = follow(client, job["id"], as_json) or job
    emit(final, as_json, job_text)
    if final.get("state") != "succeeded":
        raise SystemExit(EXIT_JOB_FAILED)


@click.command("finetune")
@click.argument("model")
@click.argument("dataset", metavar="DATA_DIR", type=click.Path(path_type=Path))  # or a dataset's name
@click.option("--name", required=True, help="the adapter's name (its dir in the adapters dir)")
@click.option("--iters", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--learning-rate", type=click.FloatRange(min=0, min_open=True), default=1e-5, show_default=True)
@click.option("--rank", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--num-layers", type=click.IntRange(min=-1), default=16, show_default=True,
              help="train the last N layers (-1: all)")
@click.option("--dora", is_flag=True, help="DoRA instead of LoRA")
@click.option("--mask-prompt", is_flag=True, help="learn from completions only, not prompts")
@click.option("--max-seq-length", type=click.IntRange(min=8), default=2048, show_default=True)
@click.option("--wait", is_flag=True, help="follow the job until it ends; exit non-zero if it fails")
@json_option
@daemon_options
def finetune(model: str, dataset: Path, name: str, iters: int, batch_size: int, learning_rate: float, rank: int,
             num_layers: int, dora: bool, mask_prompt: bool, max_seq_length: int, wait: bool, as_json: bool,
             url: str | None, config_file: Path | None, data_dir: Path | None) -> None:
    """Fine-tune a LoRA adapter for MODEL on DATA_DIR (train.jsonl, valid.jsonl: chat, completion or text
    rows), or on a dataset of the datasets dir by its name (`mlxd dataset`)."""
    client = make_client(url, config_file, data_dir)
    data = str(dataset.expanduser().resolve()) if dataset.expanduser().exists() or "/" in str(dataset) else str(dataset)
    body = {"model": model, "data": data, "name": name, "iters": iters,
            "batch_size": batch_size, "learning_rate": learning_rate, "rank": rank, "num_layers": num_layers,
            "fine_tune_type": "dora" if dora else "lora", "mask_prompt": mask_prompt, "max_seq_length": max_seq_length}
    with failures_as_click(client):
        submitted(client, client.post("/lab/finetune", body), wait, as_json)


@click.command("quantize")
@click.argument("model")
@click.option("--bits", type=click.Choice(["2", "3", "4", "5", "6", "8"]), default="4", show_default=True)
@click.option("--group-size", type=click.Choice(["32", "64", "128"]), default="64", show_default=True)
@click.option("--recipe", type=click.Choice(["mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6"]),
              help="mixed precision: the sensitive layers at the higher bits")
@click.option("--target-bpw", type=click.FloatRange(1.5, 16),
              help="dynamic quantization: measure each layer's sensitivity, reach this many bits per weight")
@click.option("--high-bits", type=click.Choice(["3", "4", "5", "6", "8"]),
              help="with --target-bpw: the sensitive layers' bits (default: --bits + 1)")
@click.option("--candidate-bits", help="with --target-bpw: the widths to share out, e.g. 3,4,6 (instead of --bits "
              "and --high-bits)")
@click.option("--method", type=click.Choice(["convert", "dynamic", "gptq", "awq", "dwq"]),
              help="convert (round to nearest; the default), dynamic (with --target-bpw), gptq, awq or dwq: "
                   "see docs/lab.md")
@click.option("--gptq", is_flag=True, help="the same as --method gptq")
@click.option("--calibration", help="calibration text for the methods that read it: a dataset, dir or file "
              "(default: mlx-lm's own, downloaded once)")
@click.option("--calibration-samples", type=click.IntRange(1, 4096), help="samples drawn from it (default 128)")
@click.option("--calibration-length", type=click.IntRange(16, 8192), help="tokens a sample (default 512)")
@click.option("--learning-rate", type=click.FloatRange(0, 1, min_open=True),
              help="dwq: the scales' learning rate (default mlx-lm's, 1e-6)")
@click.option("--name", help="the new model's name (default: MODEL-Nbit)")
@click.option("--wait", is_flag=True, help="follow the job until it ends; exit non-zero if it fails")
@json_option
@daemon_options
def quantize(model: str, bits: str, group_size: str, recipe: str | None, target_bpw: float | None,
             high_bits: str | None, candidate_bits: str | None, method: str | None, gptq: bool, calibration: str | None,
             calibration_samples: int | None, calibration_length: int | None, learning_rate: float | None,
             name: str | None, wait: bool, as_json: bool, url: str | None, config_file: Path | None,
             data_dir: Path | None) -> None:
    """Quantize MODEL into a new model in the models dir (mlx_lm.convert, or mlx-lm's dynamic
    quantization to a target bits per weight, GPTQ, AWQ or DWQ)."""
    client = make_client(url, config_file, data_dir)
    body: dict[str, Any] = {"model": model, "bits": int(bits), "group_size": int(group_size)}
    if recipe:
        body["recipe"] = recipe
    if target_bpw is not None:
        body["target_bpw"] = target_bpw
    if high_bits:
        body["high_bits"] = int(high_bits)
    if candidate_bits:
        try:
            body["candidate_bits"] = [int(b) for b in candidate_bits.split(",")]
        except ValueError:
            raise click.BadParameter("a comma-separated list of widths, e.g. 3,4,6", param_hint="--candidate-bits") from None
    if gptq and method not in (None, "gptq"):
        raise click.UsageError(f"--gptq and --method {method} say two methods")
    if gptq or method:
        body["method"] = method or "gptq"
    for key, value in (("calibration_samples", calibration_samples), ("calibration_length", calibration_length),
                       ("learning_rate", learning_rate)):
        if value is not None:
            body[key] = value
    if calibration:
        body["calibration"] = str(Path(calibration).expanduser().resolve()) if Path(calibration).expanduser().exists() \
            else calibration
    if name:
        body["name"] = name
    with failures_as_click(client):
        submitted(client, client.post("/lab/quantize", body), wait, as_json)


@click.command("fuse")
@click.argument("model")
@click.argument("adapter")
@click.option("--name", help="the new model's name (default: MODEL-ADAPTER)")
@click.option("--dequantize", is_flag=True, help="save a quantized model's weights at full precision")
@click.option("--gguf", is_flag=True, help="also write a GGUF file (llama, mistral, mixtral)")
@click.option("--wait", is_flag=True, help="follow the job until it ends; exit non-zero if it fails")
@json_option
@daemon_options
def fuse(model: str, adapter: str, name: str | None, dequantize: bool, gguf: bool, wait: bool, as_json: bool,
         url: str | None, config_file: Path | None, data_dir: Path | None) -> None:
    """Fuse ADAPTER into MODEL's weights: a new model in the models dir (mlx_lm.fuse)."""
    client = make_client(url, config_file, data_dir)
    body: dict[str, Any] = {"model": model, "adapter": adapter, "dequantize": dequantize, "gguf": gguf}
    if name:
        body["name"] = name
    with failures_as_click(client):
        submitted(client, client.post("/lab/fuse", body), wait, as_json)


@click.command("merge")
@click.argument("adapters", nargs=-1, required=True)
@click.option("--name", required=True, help="the merged adapter's name")
@click.option("--scales", help="one weight per adapter, comma-separated (default: 1 each)")
@click.option("--wait", is_flag=True, help="follow the job until it ends; exit non-zero if it fails")
@json_option
@daemon_options
def merge(adapters: tuple[str, ...], name: str, scales: str | None, wait: bool, as_json: bool, url: str | None,
          config_file: Path | None, data_dir: Path | None) -> None:
    """Merge LoRA ADAPTERS (2 to 8, of one model) into one adapter: the sum of their updates, weighted."""
    client = make_client(url, config_file, data_dir)
    body: dict[str, Any] = {"adapters": list(adapters), "name": name}
    if scales:
        try:
            body["scales"] = [float(x) for x in scales.split(",")]
        except ValueError:
            raise click.BadParameter("numbers, comma-separated", param_hint="--scales") from None
    with failures_as_click(client):
        submitted(client, client.post("/lab/merge", body), wait, as_json)


@click.command("jobs")
@click.argument("args", nargs=-1, metavar="[ID | cancel ID]")
@click.option("-f", "--follow", "follow_", is_flag=True, help="follow the job's progress until it ends")
@click.option("--kind", type=click.Choice(["finetune", "quantize", "fuse", "merge", "dataset", "push"]),
              help="only jobs of this kind")
@json_option
@daemon_options
def jobs(args: tuple[str, ...], follow_: bool, kind: str | None, as_json: bool, url: str | None,
         config_file: Path | None, data_dir: Path | None) -> None:
    """The lab's jobs, newest first; `mlxd jobs ID` shows one (-f follows it until it ends);
    `mlxd jobs cancel ID` cancels one (a queued job never starts; a running one is stopped)."""
    client = make_client(url, config_file, data_dir)
    if len(args) > 2 or (len(args) == 2 and args[0] != "cancel") or args == ("cancel",):
        raise click.UsageError("expected: mlxd jobs [ID] | mlxd jobs cancel ID")
    with failures_as_click(client):
        if len(args) == 2:
            emit(client.post(f"/lab/jobs/{quote(args[1], safe='')}/cancel"), as_json, job_text)
            return
        if not args:
            if follow_:
                raise click.UsageError("-f follows one job: give its id")
            emit(client.get("/lab/jobs" + (f"?kind={quote(kind)}" if kind else "")), as_json, jobs_text)
            return
        job_id = args[0]
        if not follow_:
            emit(client.get(f"/lab/jobs/{quote(job_id, safe='')}"), as_json, job_text)
            return
        final = follow(client, job_id, as_json)
        emit(final, as_json, job_text)
        if final.get("state") != "succeeded":
            raise SystemExit(EXIT_JOB_FAILED)
