"""A LoRA or DoRA fine-tune job, run as `mlx_lm.lora --train` runs it (its `train_model`).

The dataset is checked first (protocol/datasets.py: every line, then token lengths against
`max_seq_length`, which mlx-lm would cut longer rows to), then loaded with mlx-lm's
`load_local_dataset` and trained with mlx-lm's trainer under its own defaults for what the
request does not set. Its loss reports become the job's progress (step, loss, tokens/s, ETA).
The adapter lands in mlxd's adapters dir, its config recording the base model's id.
"""

from __future__ import annotations

import json
import time
import types
from pathlib import Path
from typing import Any

import msgspec

from mlxd.lab.worker import Emit, JobError, publish, staging_dir
from mlxd.protocol.datasets import DatasetError, check_dir
from mlxd.protocol.jobs import FinetuneRequest, Made, Progress, WorkerJob


class Reporter:
    """mlx-lm's TrainingCallback: its reports as the job's progress."""

    def __init__(self, emit: Emit, iters: int) -> None:
        self._emit, self._iters, self._started = emit, iters, time.monotonic()
        self.last_loss: float | None = None
        self.val_loss: float | None = None
        self.tokens_per_s: list[float] = []

    def on_train_loss_report(self, info: dict[str, Any]) -> None:
        step = int(info["iteration"])
        elapsed = time.monotonic() - self._started
        self.last_loss = float(info["train_loss"])
        self.tokens_per_s.append(float(info["tokens_per_second"]))
        self._emit(Progress(stage="training", step=step, total=self._iters, loss=self.last_loss,
                            val_loss=self.val_loss, tokens_per_s=float(info["tokens_per_second"]),
                            trained_tokens=int(info["trained_tokens"]),
                            eta_s=elapsed / step * (self._iters - step) if step else None))

    def on_val_loss_report(self, info: dict[str, Any]) -> None:
        self.val_loss = float(info["val_loss"])
        self._emit(Progress(stage="training", step=int(info["iteration"]), total=self._iters, val_loss=self.val_loss))


def finetune(job: WorkerJob, emit: Emit) -> Made:
    from mlx_lm.lora import CONFIG_DEFAULTS, train_model
    from mlx_lm.tuner.datasets import load_local_dataset
    from mlx_lm.utils import load

    req = msgspec.convert(job.request, FinetuneRequest)
    assert job.model_path is not None and job.data_path is not None
    final = Path(job.output_path)
    staged = staging_dir(final)
    emit(Progress(stage="checking", message="reading the dataset"))
    try:
        reports = check_dir(Path(job.data_path))
    except DatasetError as exc:
        raise JobError(str(exc)) from None
    emit(Progress(stage="loading", message=f"loading {req.model}"))
    model, tokenizer = load(job.model_path)[:2]
    num_layers = len(model.layers) if req.num_layers == -1 else req.num_layers
    if num_layers > len(model.layers):
        raise JobError(f"num_layers {num_layers}: {req.model} has only {len(model.layers)} layers")
    args = types.SimpleNamespace(**{
        **CONFIG_DEFAULTS, "model": job.model_path, "data": job.data_path, "train": True,
        "fine_tune_type": req.fine_tune_type, "num_layers": num_layers, "batch_size": req.batch_size,
        "iters": req.iters, "learning_rate": req.learning_rate, "val_batches": req.val_batches,
        "steps_per_report": req.steps_per_report, "steps_per_eval": req.steps_per_eval, "save_every": req.iters,
        "adapter_path": str(staged), "max_seq_length": req.max_seq_length, "mask_prompt": req.mask_prompt,
        "grad_checkpoint": req.grad_checkpoint, "seed": req.seed,
        "lora_parameters": {"rank": req.rank, "dropout": req.dropout, "scale": req.scale},
    })
    train_set, valid_set, _ = load_local_dataset(Path(job.data_path), tokenizer, args)  # type: ignore[arg-type]
    lengths = _lengths(train_set)
    over = sum(n > req.max_seq_length for n in lengths)
    emit(Progress(stage="checking", message=f"{len(train_set)} train rows ({reports[0].format}), "
                  f"{len(valid_set)} valid; longest {max(lengths, default=0)} tokens, "
                  f"{over} over max_seq_length {req.max_seq_length} (cut to it)"))
    if len(train_set) < req.batch_size:
        raise JobError(f"train.jsonl has {len(train_set)} rows, fewer than batch_size {req.batch_size}")
    if len(valid_set) < req.batch_size and req.val_batches != 0:
        raise JobError(f"valid.jsonl has {len(valid_set)} rows, fewer than batch_size {req.batch_size}")
    reporter = Reporter(emit, req.iters)
    started = time.monotonic()
    train_model(args, model, train_set, valid_set, reporter)  # type: ignore[arg-type]  # its callback protocol
    took = time.monotonic() - started
    config_file = staged / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model"] = job.base_model
    config_file.write_text(json.dumps(config, indent=2))
    emit(Progress(stage="saving", message=str(final)))
    publish(staged, final)
    return Made(kind="adapter", path=str(final), name=req.name, details={
        "final_loss": reporter.last_loss, "val_loss": reporter.val_loss, "seconds": round(took, 3),
        "tokens_per_s": sum(reporter.tokens_per_s) / len(reporter.tokens_per_s) if reporter.tokens_per_s else None,
        "train_rows": len(train_set), "valid_rows": len(valid_set), "over_length": over,
        "format": reports[0].format})


def _lengths(dataset: Any) -> list[int]:
    """Token counts of a dataset's rows (mlx-lm's datasets process a row on access)."""
    counts = []
    for i in range(len(dataset)):
        item = dataset.process(dataset[i]) if hasattr(dataset, "process") else dataset[i]
        tokens = item[0] if isinstance(item, tuple) else item
        counts.append(len(tokens))
    return counts
