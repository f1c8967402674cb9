"""A quantize job: `mlx_lm.convert` with `quantize=True`, to N bits or one of its mixed-precision
recipes (`mixed_3_6`: the sensitive layers at 6 bits, the rest at 3, ...). The new model lands
in mlxd's models dir, where the registry finds it, so it can be served at once."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from mlxd.lab.worker import Emit, JobError, publish, staging_dir
from mlxd.protocol.jobs import Made, Progress, QuantizeRequest, WorkerJob


def quantize(job: WorkerJob, emit: Emit) -> Made:
    from mlx_lm.convert import convert
    from mlx_lm.utils import compute_bits_per_weight, load_model

    req = msgspec.convert(job.request, QuantizeRequest)
    assert job.model_path is not None
    config = json.loads((Path(job.model_path) / "config.json").read_text())
    if config.get("quantization") or config.get("quantization_config"):
        raise JobError(f"{req.model} is quantized already; quantize the full-precision model instead")
    final = Path(job.output_path)
    staged = staging_dir(final)
    how = req.recipe or f"{req.bits}-bit, group size {req.group_size}"
    emit(Progress(stage="quantizing", message=f"{req.model} -> {final.name} ({how})"))
    convert(job.model_path, str(staged), quantize=True, q_group_size=req.group_size, q_bits=req.bits,
            quant_predicate=req.recipe)
    model, _ = load_model(staged, lazy=True)
    bpw = float(compute_bits_per_weight(model))
    size = sum(f.stat().st_size for f in staged.glob("*.safetensors"))
    emit(Progress(stage="saving", message=f"{bpw:.2f} bits per weight, {size / 1e6:.1f} MB"))
    publish(staged, final)
    return Made(kind="model", path=str(final), name=final.name,
                details={"bits_per_weight": round(bpw, 3), "size_bytes": size, "bits": req.bits,
                         "group_size": req.group_size, "recipe": req.recipe})
