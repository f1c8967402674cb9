"""Fuse and merge jobs: an adapter fused into its model's weights, and adapters merged into one.

A fuse is `mlx_lm.fuse`'s: the model loaded with the adapter (`load(..., adapter_path)`), each
adapted layer's `fuse()` (a quantized layer is quantized again, unless `dequantize`), saved
with mlx-lm's `save` as a model dir, and optionally exported to GGUF by mlx-lm's exporter.

A merge is exact: a LoRA update is `scale · x A B`, and a sum of them is one LoRA whose A holds
each adapter's A side by side and whose B holds each B (times its adapter's scale and its
weight) one under the other; its rank is their ranks' sum, and its scale 1. So the merged
adapter does what the adapters stacked would (`"a+b"`), weighted. DoRA adapters, whose update
is not a sum, are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from mlxd.lab.worker import Emit, JobError, publish, staging_dir
from mlxd.protocol.jobs import FuseRequest, Made, MergeRequest, Progress, WorkerJob


def fuse(job: WorkerJob, emit: Emit) -> Made:
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import dequantize_model, load, save

    req = msgspec.convert(job.request, FuseRequest)
    assert job.model_path is not None and job.adapter_paths
    final = Path(job.output_path)
    staged = staging_dir(final)
    emit(Progress(stage="loading", message=f"{req.model} with {req.adapter}"))
    loaded: Any = load(job.model_path, adapter_path=job.adapter_paths[0], return_config=True)
    model, tokenizer, config = loaded
    emit(Progress(stage="fusing"))
    fused = [(n, m.fuse(dequantize=req.dequantize)) for n, m in model.named_modules() if hasattr(m, "fuse")]
    if not fused:
        raise JobError(f"{req.adapter} adapts no layer of {req.model}")
    model.update_modules(tree_unflatten(fused))
    if req.dequantize:
        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    emit(Progress(stage="saving", message=str(final)))
    save(staged, job.model_path, model, tokenizer, config, donate_model=False)
    details: dict[str, object] = {"layers_fused": len(fused), "dequantized": req.dequantize}
    if req.gguf:
        from mlx_lm.gguf import convert_to_gguf

        if config.get("model_type") not in ("llama", "mixtral", "mistral"):
            raise JobError(f"GGUF export takes llama, mistral and mixtral models, not {config.get('model_type')}")
        gguf = staged / f"{final.name}.gguf"
        convert_to_gguf(staged, dict(tree_flatten(model.parameters())), config, str(gguf))
        details["gguf"] = str(final / gguf.name)
    publish(staged, final)
    return Made(kind="model", path=str(final), name=final.name, details=details)


def merge(job: WorkerJob, emit: Emit) -> Made:
    import mlx.core as mx

    req = msgspec.convert(job.request, MergeRequest)
    scales = req.scales or [1.0] * len(req.adapters)
    if len(scales) != len(req.adapters):
        raise JobError(f"{len(scales)} scales for {len(req.adapters)} adapters")
    configs: list[dict[str, Any]] = []
    tensors: list[dict[str, Any]] = []
    for name, path in zip(req.adapters, job.adapter_paths, strict=True):
        config = json.loads((Path(path) / "adapter_config.json").read_text())
        if config.get("fine_tune_type", "lora") != "lora":
            raise JobError(f"{name} is a {config.get('fine_tune_type')} adapter; only LoRA adapters merge")
        configs.append(config)
        found: Any = mx.load(str(Path(path) / "adapters.safetensors"))
        tensors.append(found)
    emit(Progress(stage="merging", message=" + ".join(f"{w:g}·{n}" for n, w in zip(req.adapters, scales, strict=True))))
    modules = sorted({k.rpartition(".")[0] for t in tensors for k in t})
    merged: dict[str, mx.array] = {}
    for module in modules:
        a_parts, b_parts = [], []
        for config, weights, weight in zip(configs, tensors, scales, strict=True):
            if f"{module}.lora_a" not in weights:
                continue
            scale = float(config["lora_parameters"]["scale"]) * weight
            a_parts.append(weights[f"{module}.lora_a"].astype(mx.float32))
            b_parts.append(weights[f"{module}.lora_b"].astype(mx.float32) * scale)
        merged[f"{module}.lora_a"] = mx.concatenate(a_parts, axis=1)
        merged[f"{module}.lora_b"] = mx.concatenate(b_parts, axis=0)
    final = Path(job.output_path)
    staged = staging_dir(final)
    staged.mkdir(parents=True)
    mx.save_safetensors(str(staged / "adapters.safetensors"), merged)
    rank = max(int(v.shape[1]) for k, v in merged.items() if k.endswith(".lora_a"))
    config = dict(configs[0])
    config.update({"fine_tune_type": "lora", "num_layers": max(int(c.get("num_layers", 0)) for c in configs),
                   "lora_parameters": {"rank": rank, "scale": 1.0, "dropout": 0.0},
                   "base_model": job.base_model, "merged_from": list(req.adapters), "merge_scales": scales})
    (staged / "adapter_config.json").write_text(json.dumps(config, indent=2))
    publish(staged, final)
    return Made(kind="adapter", path=str(final), name=req.name, details={"rank": rank, "modules": len(modules)})
