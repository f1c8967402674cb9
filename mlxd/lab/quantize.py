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

Calibration text is a dataset (its rows' text), a text or JSON-lines file, or by default
mlx-lm's own calibration file (which mlx-lm downloads once into ~/.cache/mlx-lm).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from mlxd.lab.worker import Emit, JobError, publish, staging_dir
from mlxd.protocol.jobs import Made, Progress, QuantizeRequest, WorkerJob


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
    if method == "convert":
        _convert(job, req, staged, emit)
    else:
        _calibrated(job, req, method, staged, emit)
    model, _ = load_model(staged, lazy=True)
    bpw = float(compute_bits_per_weight(model))
    size = sum(f.stat().st_size for f in staged.glob("*.safetensors"))
    emit(Progress(stage="saving", message=f"{bpw:.2f} bits per weight, {size / 1e6:.1f} MB"))
    publish(staged, final)
    return Made(kind="model", path=str(final), name=final.name,
                details={"bits_per_weight": round(bpw, 3), "size_bytes": size, "bits": req.bits,
                         "group_size": req.group_size, "recipe": req.recipe, "method": method,
                         "target_bpw": req.target_bpw})


def _convert(job: WorkerJob, req: QuantizeRequest, staged: Path, emit: Emit) -> None:
    from mlx_lm.convert import convert

    how = req.recipe or f"{req.bits}-bit, group size {req.group_size}"
    emit(Progress(stage="quantizing", message=f"{req.model} -> {Path(job.output_path).name} ({how})"))
    convert(str(job.model_path), str(staged), quantize=True, q_group_size=req.group_size, q_bits=req.bits,
            quant_predicate=req.recipe)


def _calibrated(job: WorkerJob, req: QuantizeRequest, method: str, staged: Path, emit: Emit) -> None:
    import mlx.core as mx
    from mlx_lm.utils import load, quantize_model, save

    emit(Progress(stage="loading", message=f"{req.model}"))
    model, tokenizer, config = load(str(job.model_path), return_config=True)  # type: ignore[misc]
    mx.random.seed(0)
    data = calibration(job.data_path, tokenizer, req.calibration_samples, req.calibration_length)
    emit(Progress(stage="calibrating", message=f"{data.shape[0]} calibration samples of {data.shape[1]} tokens"))
    gs = req.group_size
    if method == "gptq":
        from mlx_lm.quant.gptq import gptq_quantize

        emit(Progress(stage="quantizing", message=f"GPTQ to {req.bits} bits, group size {gs}"))
        model, config["quantization"] = gptq_quantize(model, data, req.bits, gs, 6, 64)
    else:
        from mlx_lm.quant.dynamic_quant import estimate_sensitivities, estimate_threshold

        high = req.high_bits or min(8, req.bits + 1)
        assert req.target_bpw is not None
        emit(Progress(stage="measuring", message=f"each layer's sensitivity, {req.bits} vs {high} bits"))
        sensitivities = dict(estimate_sensitivities(model, data, req.bits, gs, high, gs))
        threshold = estimate_threshold(model, sensitivities, req.target_bpw, req.bits, gs, high, gs)

        def predicate(path: str, module: Any) -> bool | dict[str, int]:
            if not hasattr(module, "to_quantized"):
                return False
            return {"bits": high, "group_size": gs} if sensitivities[path] > threshold else True

        emit(Progress(stage="quantizing", message=f"to {req.target_bpw} bits per weight ({req.bits} and {high} bits)"))
        model, config = quantize_model(model, config, group_size=gs, bits=req.bits, quant_predicate=predicate)
    save(staged, str(job.model_path), model, tokenizer, config)


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
