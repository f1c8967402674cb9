"""LoRA and DoRA adapters read from mlx-lm's adapter dirs, checked against the loaded model.

An adapter dir is what `mlx_lm.lora` writes: `adapter_config.json` (`fine_tune_type`, `num_layers`,
`lora_parameters` with `rank` and `scale`) and `adapters.safetensors`, whose tensors are named by
the module they adapt (`model.layers.3.self_attn.q_proj.lora_a`, (in, rank); `.lora_b`, (rank,
out); DoRA adds `.m`, (out,)). What is kept per module is ready for a forward pass in the model's
dtype: A, B with the scale folded in, and for DoRA the per-output gain `m / ||W + scale·(AB)ᵀ||`
(the row norm is of fixed weights, so it is computed once here instead of every step as
mlx-lm's training layer does). Serving them per row is adapter_bank.py's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
KINDS = ("lora", "dora")


class AdapterError(Exception):
    """The adapter cannot be used with this model; the message says why."""


@dataclass(frozen=True, eq=False, slots=True)
class ModuleUpdate:
    """One module's low-rank update: out += (x @ a) @ b, then (DoRA) out = gain·out (bias aside)."""

    a: mx.array  # (in, rank)
    b: mx.array  # (rank, out), the scale folded in
    gain: mx.array | None = None  # (out,): DoRA's magnitude over the adapted weight's row norm


@dataclass(eq=False, slots=True)
class Adapter:
    """An adapter read for one loaded model (immutable once read; rows hold it while they run)."""

    id: str
    path: Path
    kind: str
    rank: int
    scale: float
    modules: dict[str, ModuleUpdate] = field(default_factory=dict)
    digest: bytes = b""  # of its files: the prompt cache's namespace for rows under it

    @property
    def nbytes(self) -> int:
        return sum(u.a.nbytes + u.b.nbytes + (u.gain.nbytes if u.gain is not None else 0)
                   for u in self.modules.values())


def read_config(path: Path) -> dict[str, Any]:
    """The adapter dir's config; AdapterError when it is missing or not an mlx-lm adapter config."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path} is not an adapter dir (no {CONFIG_FILE})") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path / CONFIG_FILE} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path / CONFIG_FILE} is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind == "full":
        raise AdapterError(f"{path} holds a full fine-tune, not an adapter: fuse it or serve it as a model")
    if kind not in KINDS:
        raise AdapterError(f"{path}: fine_tune_type {kind!r} is not one of {', '.join(KINDS)}")
    params = config.get("lora_parameters")
    if not isinstance(params, dict) or not isinstance(params.get("scale"), int | float):
        raise AdapterError(f"{path / CONFIG_FILE} has no lora_parameters.scale")
    return config


def read_adapter(path: Path, adapter_id: str, model: nn.Module) -> Adapter:
    """Read the adapter at `path` for `model`; AdapterError naming what does not fit."""
    config = read_config(path)
    kind = str(config.get("fine_tune_type", "lora"))
    scale = float(config["lora_parameters"]["scale"])
    weights_file = path / WEIGHTS_FILE
    try:
        tensors = mx.load(str(weights_file))
    except (OSError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"{weights_file} cannot be read: {exc}") from None
    assert isinstance(tensors, dict)
    updates: dict[str, dict[str, mx.array]] = {}
    for name, tensor in tensors.items():
        module, _, part = name.rpartition(".")
        if part not in ("lora_a", "lora_b", "m") or not module:
            raise AdapterError(f"{weights_file}: unexpected tensor {name}")
        updates.setdefault(module, {})[part] = tensor
    if not updates:
        raise AdapterError(f"{weights_file} holds no LoRA tensors")
    adapter = Adapter(adapter_id, path, kind, 0, scale, digest=_digest(path))
    for name, parts in sorted(updates.items()):
        adapter.modules[name] = _update(name, parts, find_module(model, name), kind, scale)
        adapter.rank = max(adapter.rank, int(parts["lora_a"].shape[1]))
    mx.eval([[u.a, u.b, *([u.gain] if u.gain is not None else [])] for u in adapter.modules.values()])
    return adapter


def find_module(model: nn.Module, name: str) -> nn.Module:
    """The module at dotted `name` (`model.layers.3.self_attn.q_proj`); AdapterError if none."""
    node: Any = model
    for part in name.split("."):
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise AdapterError(f"the model has no module {name} (an adapter for another model?)") from None
    if not isinstance(node, nn.Linear | nn.QuantizedLinear):
        raise AdapterError(f"{name} is a {type(node).__name__}; adapters are served on linear layers only")
    return node


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """(in, out) of a Linear or QuantizedLinear."""
    out, cols = module.weight.shape
    if isinstance(module, nn.QuantizedLinear):
        return cols * 32 // module.bits, out
    return cols, out


def compute_dtype(module: nn.Module) -> mx.Dtype:
    """The dtype the module's outputs have (a quantized layer's: its scales')."""
    return module.scales.dtype if isinstance(module, nn.QuantizedLinear) else module.weight.dtype


def dense_weight(module: nn.Module) -> mx.array:
    """The module's weight as a dense (out, in) matrix."""
    if isinstance(module, nn.QuantizedLinear):
        mode: str = getattr(module, "mode", "affine")
        return mx.dequantize(module.weight, module.scales, module.get("biases"), module.group_size, module.bits,
                             mode=mode)
    return module.weight


def _update(name: str, parts: dict[str, mx.array], module: nn.Module, kind: str, scale: float) -> ModuleUpdate:
    a, b = parts.get("lora_a"), parts.get("lora_b")
    if a is None or b is None:
        raise AdapterError(f"{name} lacks lora_a or lora_b")
    d_in, d_out = linear_dims(module)
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != d_in or b.shape[1] != d_out or a.shape[1] != b.shape[0]:
        raise AdapterError(
            f"{name}: the adapter's shapes {tuple(a.shape)} x {tuple(b.shape)} do not fit the model's "
            f"{d_in} -> {d_out} layer (an adapter for another model?)")
    dtype = compute_dtype(module)
    gain = None
    if kind == "dora":
        m = parts.get("m")
        if m is None or m.shape != (d_out,):
            raise AdapterError(f"{name}: a DoRA adapter needs m of shape ({d_out},)")
        w = dense_weight(module).astype(mx.float32)
        adapted = w + (scale * b.astype(mx.float32).T) @ a.astype(mx.float32).T
        gain = (m.astype(mx.float32) / mx.linalg.norm(adapted, axis=1)).astype(dtype)
    return ModuleUpdate(a.astype(dtype), (scale * b.astype(mx.float32)).astype(dtype), gain)


def _digest(path: Path) -> bytes:
    """What the adapter's files hold, hashed: a retrained adapter under the same name differs."""
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        h.update((path / name).read_bytes())
    return h.digest()
