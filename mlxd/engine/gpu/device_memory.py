"""The device an engine runs on and the memory it may size itself within (protocol/sizing.py).

Read once, at load, on the GPU thread: Metal's recommended working set on macOS, the CUDA
device's memory, 75% of RAM on the CPU (the pool's default budget share). The supervisor's
`--memory-bytes` (its budget) bounds each; the weights are what MLX holds once they are loaded.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import psutil

from mlxd.engine.gpu.options import GatewayOptions
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.protocol.memory import kv_bytes_per_token, text_config
from mlxd.protocol.sizing import Device, Sizing, kv_memory_tokens, size_engine

log = logging.getLogger("mlxd.engine")
CPU_MEMORY_SHARE = 0.75  # of RAM, on the CPU: [pool] memory_fraction's default


def device_kind() -> Device:
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return "cpu"


def device_memory_bytes(device: Device) -> int | None:
    """What this device offers a model's weights and KV (None: it does not say)."""
    if device == "cpu":
        return int(psutil.virtual_memory().total * CPU_MEMORY_SHARE)
    info = mx.device_info()
    key = "max_recommended_working_set_size" if device == "metal" else "total_memory"
    value = info.get(key, info.get("memory_size"))
    return int(value) if isinstance(value, int) and value > 0 else None


def weights_bytes(loaded: LoadedModel) -> int:
    """The bytes MLX holds once the model is loaded (its files' size where MLX cannot say)."""
    active = int(mx.get_active_memory())
    return active if active > 0 else sum(f.stat().st_size for f in loaded.path.glob("*.safetensors"))


def size_for(loaded: LoadedModel, opts: GatewayOptions) -> Sizing:
    """The width (`--batch`, or auto's choice) and KV budget for this model on this device."""
    device = device_kind()
    memory = device_memory_bytes(device)
    if opts.memory_bytes is not None:
        memory = opts.memory_bytes if memory is None else min(memory, opts.memory_bytes)
    per_token = kv_bytes_per_token(text_config(loaded.config))
    tokens = kv_memory_tokens(memory, weights_bytes(loaded), opts.prompt_cache_bytes, per_token)
    return size_engine(width=opts.batch, context=loaded.context_window, memory_tokens=tokens, device=device,
                       kv_budget_tokens=opts.kv_budget_tokens)
