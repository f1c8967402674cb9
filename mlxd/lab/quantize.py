"""A quantize job, on mlx-lm's tools. The new model lands in mlxd's models dir, where the registry
finds it, so it can be served at once.

- `convert`: `mlx_lm.convert` with `quantize=True`, every layer to N bits (round to nearest), or
  one of its mixed-precision recipes (`mixed_3_6`: the sensitive layers at 6 bits, the rest at 3).
- `dynamic`: mlx-lm's dynamic quantization (`mlx_lm.quant.dynamic_quant`) to a target bits per
  weight: each layer's sensitivity (how much the model's output moves, on calibration text,
  when that layer drops from `high_bits` to `bits`) is measured, and the most sensitive layers
  keep `high_bits` until the model is at the target.
- `gptq`: mlx-lm's GPTQ (`mlx_lm.quant.gptq`): each linear layer's rounding corrects the error
  its calibration inputs would see; other quantizable layers go to 6 bits.
- `awq`: mlx-lm's AWQ (`mlx_lm.quant.awq`): block by block, the input channels its calibration
  activations show to matter are scaled up before rounding (and the weights clipped) where that
  brings the block's output nearer the full model's; embeddings and the output head at 4 bits
  (or N, above 4).
- `dwq`: mlx-lm's DWQ (`mlx_lm.quant.dwq`): the model rounded to N bits, then its scales and
  biases trained so that its outputs on the calibration text match the full model's (the
  teacher, held beside it). The job reports that distance (mean KL divergence per token, on
  held-out calibration rows) before and after.

Calibration text is a dataset (its rows' text), a text or JSON-lines file, or by default
mlx-lm's own calibration file (which mlx-lm downloads once into ~/.cache/mlx-lm).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from mlxd.lab.worker import Emit, JobError, publish, staging_dir
from mlxd.protocol.jobs import DWQ_LEARNING_RATE, Made, Progress, QuantizeRequest, WorkerJob

DWQ_BATCH = 4  # mlx_lm.quant.dwq's --batch-size


def quantize(job: WorkerJob, emit: Emit) -> Made:
    from mlx_lm.utils import compute_bits_per_weight, load_model

    req = msgspec.convert(job.request, QuantizeRequest)
    assert job.model_path is not None
    config = json.loads((Path(job.model_path) / "config.json").read_text())
    if config.get("quantization") or config.get("quantization_config"):
        raise JobError(f"{req.model} is quantized already; quantize the full-precision model instead")
    final = Path(job.output_path)
    staged = staging_dir(final)
    method = req.how()
    learned: dict[str, Any] = {}
    if method == "convert":
        _convert(job, req, staged, emit)
    else:
        learned = _calibrated(job, req, method, staged, emit)
    model, _ = load_model(staged, lazy=True)
    bpw = float(compute_bits_per_weight(model))
    size = sum(f.stat().st_size for f in staged.glob("*.safetensors"))
    emit(Progress(stage="saving", message=f"{bpw:.2f} bits per weight, {size / 1e6:.1f} MB"))
    publish(staged, final)
    return Made(kind="model", path=str(final), name=final.name,
                details={"bits_per_weight": round(bpw, 3), "size_bytes": size, "bits": req.bits,
                         "group_size": req.group_size, "recipe": req.recipe, "method": method,
                         "target_bpw": req.target_bpw, **learned})


def _convert(job: WorkerJob, req: QuantizeRequest, staged: Path, emit: Emit) -> None:
    from mlx_lm.convert import convert

    how = req.recipe or f"{req.bits}-bit, group size {req.group_size}"
    emit(Progress(stage="quantizing", message=f"{req.model} -> {Path(job.output_path).name} ({how})"))
    convert(str(job.model_path), str(staged), quantize=True, q_group_size=req.group_size, q_bits=req.bits,
            quant_predicate=req.recipe)


def _calibrated(job: WorkerJob, req: QuantizeRequest, method: str, staged: Path, emit: Emit) -> dict[str, Any]:
    """Quantize by a calibrated method into `staged`; what it learned, for the job's result."""
    import mlx.core as mx
    from mlx_lm.utils import load, quantize_model, save

    emit(Progress(stage="loading", message=f"{req.model}"))
    model, tokenizer, config = load(str(job.model_path), return_config=True)  # type: ignore[misc]
    mx.random.seed(0)
    held_out = max(DWQ_BATCH, req.calibration_samples // 8) if method == "dwq" else 0
    data = calibration(job.data_path, tokenizer, req.calibration_samples + held_out, req.calibration_length)
    emit(Progress(stage="calibrating", message=f"{data.shape[0]} calibration samples of {data.shape[1]} tokens"))
    gs = req.group_size
    learned: dict[str, Any] = {}
    if method == "dwq":
        model, config, learned = _dwq(model, config, data, held_out, req, emit)
    elif method == "awq":
        from mlx_lm.quant import awq
        from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, awq_quantize, update_config

        awq_config = AWQ_MODEL_CONFIGS.get(str(config.get("model_type")))
        if awq_config is None:
            raise JobError(f"AWQ does not know the model type {config.get('model_type')!r}")
        embed_bits = max(4, req.bits)
        emit(Progress(stage="quantizing", message=f"AWQ to {req.bits} bits, group size {gs}, block by block "
                                                  f"(embeddings and output head at {embed_bits} bits)"))
        with progress_bars(emit, "quantizing", awq):  # a step a block
            awq_quantize(model, data, awq_config, group_size=gs, bits=req.bits, embed_group_size=min(32, gs),
                         embed_bits=embed_bits)
        config = update_config(model, config)
    elif method == "gptq":
        from mlx_lm.quant import gptq
        from mlx_lm.quant.gptq import gptq_quantize

        emit(Progress(stage="quantizing", message=f"GPTQ to {req.bits} bits, group size {gs}"))
        with progress_bars(emit, "quantizing", gptq):  # the Hessians' batches, then a step a layer
            model, config["quantization"] = gptq_quantize(model, data, req.bits, gs, 6, 64)
    elif req.candidate_bits:
        model, config, learned = _several_widths(model, config, data, req, emit)
    else:
        from mlx_lm.quant import dynamic_quant
        from mlx_lm.quant.dynamic_quant import estimate_sensitivities, estimate_threshold

        high = req.high_bits or min(8, req.bits + 1)
        assert req.target_bpw is not None
        emit(Progress(stage="measuring", message=f"each layer's sensitivity, {req.bits} vs {high} bits"))
        with progress_bars(emit, "measuring", dynamic_quant):  # a step a batch of 4 samples
            sensitivities = dict(estimate_sensitivities(model, data, req.bits, gs, high, gs))
        threshold = estimate_threshold(model, sensitivities, req.target_bpw, req.bits, gs, high, gs)

        def predicate(path: str, module: Any) -> bool | dict[str, int]:
            if not hasattr(module, "to_quantized"):
                return False
            return {"bits": high, "group_size": gs} if sensitivities[path] > threshold else True

        emit(Progress(stage="quantizing", message=f"to {req.target_bpw} bits per weight ({req.bits} and {high} bits)"))
        model, config = quantize_model(model, config, group_size=gs, bits=req.bits, quant_predicate=predicate)
    save(staged, str(job.model_path), model, tokenizer, config)
    return learned


def _several_widths(model: Any, config: dict[str, Any], data: Any, req: QuantizeRequest,
                    emit: Emit) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Dynamic quantization over `req.candidate_bits` (lab/mixed_bits.py): each layer's
    sensitivity at every width below the highest, then the widths shared out for the target."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.quant import dynamic_quant
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities
    from mlx_lm.utils import quantize_model

    from mlxd.lab.mixed_bits import allocate, layer_bits

    assert req.candidate_bits is not None and req.target_bpw is not None
    levels, gs = sorted(req.candidate_bits), req.group_size
    loss: dict[int, dict[str, float]] = {}
    for bits in levels[:-1]:  # each pass's batches are its steps (progress_bars)
        emit(Progress(stage="measuring", message=f"each layer's sensitivity, {bits} vs {levels[-1]} bits"))
        with progress_bars(emit, "measuring", dynamic_quant):
            loss[bits] = dict(estimate_sensitivities(model, data, bits, gs, levels[-1], gs))
    layers: Any = tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
    quantizable = {path: m for path, m in layers if hasattr(m, "to_quantized") and m.weight.shape[-1] % gs == 0}
    sizes = {path: int(m.weight.size) for path, m in quantizable.items()}
    # The sensitivities are per million weights (mlx-lm's); the knapsack weighs a layer's whole loss.
    loss = {bits: {p: v * sizes[p] / 1e6 for p, v in per.items() if p in sizes} for bits, per in loss.items()}
    params: Any = tree_flatten(model.parameters())
    dtype_bits = next(v.dtype.size for _, v in params) * 8
    total_weights = sum(v.size for _, v in params)
    fixed = sum(v.size * v.dtype.size * 8 for k, v in params if not (k.endswith(".weight") and k[:-7] in sizes))
    overhead = 2 * dtype_bits / gs  # an affine group's scale and bias
    chosen = allocate(sizes, levels, loss, req.target_bpw * total_weights - fixed, overhead)
    spent = sum(layer_bits(sizes[p], b, overhead) for p, b in chosen.items())
    counts = {str(b): sum(1 for v in chosen.values() if v == b) for b in levels}
    emit(Progress(stage="quantizing", message=f"to {req.target_bpw} bits per weight: layers at "
                  + ", ".join(f"{b} bits: {n}" for b, n in counts.items())
                  + f" (estimated {(spent + fixed) / total_weights:.2f} bits per weight)"))

    def predicate(path: str, module: Any) -> bool | dict[str, int]:
        if path not in chosen:
            return False
        return {"bits": chosen[path], "group_size": gs}

    model, config = quantize_model(model, config, group_size=gs, bits=levels[0], quant_predicate=predicate)
    return model, config, {"candidate_bits": levels, "layers_by_bits": counts}


def _dwq(teacher: Any, config: dict[str, Any], data: Any, held_out: int, req: QuantizeRequest,
         emit: Emit) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """mlx-lm's DWQ: a copy of `teacher` rounded to req.bits, its scales and biases trained on
    `data`'s rows (the last `held_out` kept to measure it) to give the teacher's outputs. The
    student, its config, and the distance to the teacher before and after."""
    import copy

    import mlx.core as mx
    import mlx.optimizers as optimizers
    from mlx.utils import tree_flatten
    from mlx_lm.quant.dwq import dwq_quantize
    from mlx_lm.utils import quantize_model

    rows = [(row, 0) for row in data.tolist()]
    train, valid = rows[:-held_out], rows[-held_out:]
    if len(train) < DWQ_BATCH:
        raise JobError(f"DWQ needs at least {DWQ_BATCH + held_out} calibration samples ({DWQ_BATCH} to train on, "
                       f"{held_out} to measure); the calibration text gave {len(rows)} (give more text, or a smaller "
                       "calibration_length)")
    student = copy.deepcopy(teacher)
    student, config = quantize_model(student, config, group_size=req.group_size, bits=req.bits)
    pairs: Any = tree_flatten(student.parameters())
    dtype = next(v.dtype for k, v in pairs if k.endswith(".scales"))
    before = round(_distance(student, teacher, valid), 6)
    steps = len(train) // DWQ_BATCH
    rate = req.learning_rate or DWQ_LEARNING_RATE
    emit(Progress(stage="training", step=0, total=steps, val_loss=before,
                  message=f"DWQ to {req.bits} bits: {steps} steps at learning rate {rate:g}"))
    start = time.monotonic()

    def target(batch: Any, index: int, split: str) -> Any:
        if split == "train" and index:
            spent = time.monotonic() - start
            emit(Progress(stage="training", step=index, total=steps, eta_s=round(spent / index * (steps - index), 1)))
        return teacher(batch)

    dwq_quantize(student, target, optimizers.Adam(learning_rate=rate, bias_correction=True), train, valid,
                 batch_size=DWQ_BATCH, max_seq_length=data.shape[1], seed=0, dtype=dtype)
    student.eval()
    after = round(_distance(student, teacher, valid), 6)
    emit(Progress(stage="training", step=steps, total=steps, val_loss=after,
                  message=f"mean KL to the full model on {len(valid)} held-out rows: {before:.5f} -> {after:.5f}"))
    mx.eval(student.parameters())
    return student, config, {"learning_rate": rate, "kl_before": before, "kl_after": after}


def _distance(student: Any, teacher: Any, rows: list[tuple[list[int], int]]) -> float:
    """The mean KL divergence per token of `student`'s next-token distribution from `teacher`'s."""
    import mlx.core as mx
    from mlx_lm.tuner.losses import kl_div_loss

    total = 0.0
    for at in range(0, len(rows), DWQ_BATCH):  # a batch's logits at a time: the vocabulary is wide
        tokens = mx.array([row for row, _ in rows[at:at + DWQ_BATCH]])[:, :-1]
        losses = kl_div_loss(student(tokens).astype(mx.float32), teacher(tokens).astype(mx.float32))
        total += float(losses.sum().item())
    return total / (len(rows) * (len(rows[0][0]) - 1))


@contextlib.contextmanager
def progress_bars(emit: Emit, stage: str, *modules: Any) -> Iterator[None]:
    """While it lasts, the progress bars of mlx-lm's quantizers in `modules` (their `tqdm`)
    also emit the job's progress: one event per item done, with its step, total and ETA."""
    from tqdm import tqdm

    class Emitting(tqdm):
        def __iter__(self) -> Iterator[Any]:
            start = time.monotonic()
            for done, item in enumerate(super().__iter__(), start=1):
                yield item
                total = self.total if isinstance(self.total, int) else None
                eta = (time.monotonic() - start) / done * (total - done) if total else None
                emit(Progress(stage=stage, step=done, total=total, message=self.desc or None,
                              eta_s=round(eta, 1) if eta is not None else None))

    saved = [(m, m.tqdm) for m in modules]
    for m in modules:
        m.tqdm = Emitting
    try:
        yield
    finally:
        for m, original in saved:
            m.tqdm = original


def calibration(source: str | None, tokenizer: Any, samples: int, length: int) -> Any:
    """Calibration token rows (samples x length), drawn from `source`'s text in random order."""
    import mlx.core as mx

    if source is None:
        from mlx_lm.quant.utils import load_data

        return load_data(tokenizer, samples, length)
    text = "\n\n".join(_texts(Path(source)))
    tokens = mx.array(tokenizer.encode(text))
    count = tokens.size // length
    if count == 0:
        raise JobError(f"the calibration text is {tokens.size} tokens; a sample needs {length} "
                       "(give more text, or a smaller calibration_length)")
    rows = tokens[: count * length].reshape(count, length)
    return rows[mx.random.permutation(count)[:samples]]


def _texts(path: Path) -> list[str]:
    """The text of a calibration source: a dataset dir's rows, a JSON-lines file's, or a text file."""
    if path.is_dir():
        files = [path / f"{split}.jsonl" for split in ("train", "valid", "test") if (path / f"{split}.jsonl").is_file()]
    else:
        files = [path]
    out: list[str] = []
    for file in files:
        raw = file.read_text(encoding="utf-8", errors="replace")
        if file.suffix != ".jsonl":
            out.append(raw)
            continue
        for line in raw.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                out.append(_row_text(row))
    return [t for t in out if t]


def _row_text(row: dict[str, Any]) -> str:
    if isinstance(row.get("messages"), list):
        return "\n".join(str(m.get("content") or "") for m in row["messages"] if isinstance(m, dict))
    if "prompt" in row:
        return f"{row.get('prompt', '')}{row.get('completion', '')}"
    return str(row.get("text") or "")
