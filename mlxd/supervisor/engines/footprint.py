"""How much memory an engine will take: its weights plus the KV cache its sizing books.

An estimate for the pool's memory budget, made from files alone (no mlx in the supervisor).
The rule is `mlxd.protocol.sizing`'s, which the engine applies at load with the same inputs
(the memory the pool lets it use, the weights, the prompt cache's RAM tier), so what the pool
books is what the engine takes, or more where the device holds less than the pool's budget.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from mlxd.protocol.memory import context_window, kv_bytes_per_token, text_config
from mlxd.protocol.sizing import Device, Sizing, kv_memory_tokens, size_engine
from mlxd.supervisor.model_inspect import InspectError, read_header

log = logging.getLogger("mlxd.supervisor")


def plan(model_dir: Path, weights_bytes: int, *, max_context: int | None, batch: int | None,
         memory_bytes: int | None, prompt_cache_bytes: int, device: Device) -> tuple[Sizing, int] | None:
    """The sizing an engine for this model will choose (width None: auto), and a token's KV bytes;
    None when its config.json lacks the sizes."""
    cfg = _text_config(model_dir)
    per_token = kv_bytes_per_token(cfg) if cfg is not None else 0
    if cfg is None or per_token <= 0:
        return None
    tokens = kv_memory_tokens(memory_bytes, weights_bytes, prompt_cache_bytes, per_token)
    return size_engine(width=batch, context=context_window(cfg, max_context), memory_tokens=tokens,
                       device=device), per_token


def estimate_bytes(model_dir: Path, weights_bytes: int, max_context: int | None = None, batch: int | None = 1, *,
                   memory_bytes: int | None = None, prompt_cache_bytes: int = 0, device: Device = "cpu") -> int:
    """Weights plus the KV cache the engine's sizing books (`plan`); the prompt cache is the caller's."""
    planned = plan(model_dir, weights_bytes, max_context=max_context, batch=batch, memory_bytes=memory_bytes,
                   prompt_cache_bytes=prompt_cache_bytes, device=device)
    if planned is None:
        return weights_bytes
    sizing, per_token = planned
    return weights_bytes + sizing.kv_budget_tokens * per_token


def this_device() -> Device:
    """The device this machine's engines run on, as the supervisor can tell without mlx: Metal on
    macOS, CUDA where an MLX CUDA build and an NVIDIA driver are installed, else the CPU. (The
    engine reads the real one; this only sets the widest width the pool's estimate plans for.)"""
    if sys.platform == "darwin":
        return "metal"
    if shutil.which("nvidia-smi") is not None:
        for name in ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda"):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                importlib.metadata.distribution(name)
                return "cuda"
    return "cpu"


RAM_FRACTION = 0.75  # [pool] memory_fraction's default where the models live in RAM (Metal, the CPU)
GPU_FRACTION = 1.0  # ... and on CUDA, of the GPU's memory: nothing else lives there, and the
# engine keeps its own headroom for activations (protocol/sizing.py)


def default_budget_bytes(fraction: float | None, device: Device = "cpu") -> int:
    """`fraction` of the memory the engines' models live in: on CUDA the smallest visible GPU's
    (an engine runs on one; where its memory cannot be read, RAM's), else physical RAM."""
    if fraction is None:
        fraction = GPU_FRACTION if device == "cuda" and visible_gpu_memory_bytes() is not None else RAM_FRACTION
    return int(models_memory_bytes(device) * fraction)


def models_memory_bytes(device: Device) -> int:
    """The memory the engines' models live in: on CUDA the smallest visible GPU's (where it can be
    read), else physical RAM."""
    if device == "cuda" and (gpu := visible_gpu_memory_bytes()) is not None:
        return gpu
    return int(psutil.virtual_memory().total)


@functools.cache
def visible_gpu_memory_bytes() -> int | None:
    """`gpu_memory_bytes()` for this process, asked of nvidia-smi once (the budget and the
    library's machine both want it, and the cards do not change while mlxd runs)."""
    return gpu_memory_bytes()


def gpu_memory_bytes(environ: Mapping[str, str] | None = None, smi: str = "nvidia-smi") -> int | None:
    """The memory of the smallest GPU this process's CUDA can see, as nvidia-smi reports it,
    without creating a CUDA context (which would hold some of that memory); None when it cannot
    be read, no GPU is visible, or MIG splits a card (CUDA then sees a slice, whose size this
    does not read: set [pool] memory_budget_gb).

    `$CUDA_VISIBLE_DEVICES` is followed by UUID (or a UUID's prefix, as CUDA takes it), and by
    index only under `CUDA_DEVICE_ORDER=PCI_BUS_ID`: nvidia-smi numbers the cards in PCI order,
    CUDA by default fastest first, so an index may name another card; then the smallest of all
    counts (the safe side where the cards differ)."""
    try:
        done = subprocess.run([smi, "--query-gpu=index,uuid,memory.total,mig.mode.current",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    cards: list[tuple[str, str, int]] = []
    for line in done.stdout.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 4:
            continue
        if parts[3].lower() == "enabled":
            log.warning("GPU %s is split by MIG: the pool cannot tell a slice's memory; its budget is RAM's share "
                        "unless [pool] memory_budget_gb says otherwise", parts[0])
            return None
        if parts[0].isdigit() and parts[2].isdigit():  # anything else is not a card's line
            cards.append((parts[0], parts[1], int(parts[2]) * 1024**2))  # MiB
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        wanted = []
        for name in (name.strip() for name in visible.split(",")):
            if not name or name.startswith("-"):  # CUDA stops at the first invalid entry
                break
            wanted.append(name)
        by_index = env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
        chosen = [card for card in cards if any(
            (name.startswith("GPU-") and card[1].startswith(name)) or (name.isdigit() and int(name) == int(card[0]))
            for name in wanted)]
        if not by_index and any(name.isdigit() for name in wanted):
            chosen = cards  # some card of them all: the smallest counts
        cards = chosen
    return min((size for _, _, size in cards), default=None)


def _text_config(model_dir: Path) -> dict[str, Any] | None:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return text_config(cfg) if isinstance(cfg, dict) else None


def group_share(model_dir: Path, weights_bytes: int, ranks: int, mode: str) -> tuple[int, float]:
    """What the largest rank of an engine group holds: its bytes of the weights, and its share of
    the KV (and of anything sized like it).

    Each rank splits the model before it reads it (engine/group/). Tensor parallel splits every
    layer's projections and KV heads N ways; a pipeline gives each rank a run of whole layers, the
    largest ceil(L/N) of them. What sits outside the layers (the embeddings, the head, the final
    norm) every rank is taken to hold whole: more than a pipeline's middle ranks keep, the safe
    side. The layers' part is read from the safetensors headers; a model whose headers cannot be
    read is taken as all layers."""
    layers, whole = _layer_bytes(model_dir)
    cfg = _text_config(model_dir) or {}
    count = cfg.get("num_hidden_layers")
    if mode == "pipeline" and isinstance(count, int) and count >= ranks:
        share = -(-count // ranks) / count
    else:
        share = 1 / ranks
    total = layers + whole
    if total <= 0:
        return -(-weights_bytes // ranks), share
    scale = weights_bytes / total  # the headers' bytes in the measure the pool uses (files on disk)
    return int((layers * share + whole) * scale), share


def _layer_bytes(model_dir: Path) -> tuple[int, int]:
    """Bytes of the tensors inside the model's repeated layers, and of the rest (0, 0: unreadable)."""
    layers = whole = 0
    try:
        headers = [read_header(f) for f in sorted(model_dir.glob("*.safetensors"))]
    except InspectError:
        return 0, 0
    for header in headers:
        for name, tensor in header.items():
            try:
                start, end = tensor["data_offsets"]
            except (KeyError, TypeError, ValueError):
                return 0, 0
            if ".layers." in f".{name}":
                layers += end - start
            else:
                whole += end - start
    return layers, whole
