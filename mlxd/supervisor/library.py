"""The library: every model on disk, whether it fits this machine, and how fast it should decode.

The fit's arithmetic is protocol/fit.py's; this reads its inputs without mlx: each model's
config and safetensors headers (the embedding table's bytes, whether a separate head exists),
the pool's memory budget, mlxd's own measured decode rate (the timeline), and the machine's
bandwidth. That is measured once by `python -m mlxd.engine.bandwidth` in a child process (the
supervisor never imports mlx) and kept in the data dir as `probe/bandwidth.json`; it is
measured again when MLX's version changes or the file goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from mlxd.protocol import fit
from mlxd.protocol.capabilities import capabilities
from mlxd.protocol.memory import kv_bytes_per_token, text_config
from mlxd.supervisor.model_inspect import InspectError, read_header
from mlxd.supervisor.registry import ModelEntry, capabilities_of

log = logging.getLogger("mlxd.supervisor")
PROBE_TIMEOUT_S = 300.0  # a first start on a GPU compiles kernels: a minute or more


def mlx_version() -> str | None:
    try:
        return importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError:
        return None


class Bandwidth:
    """The machine's measured bandwidth, kept at `path` (None: in memory only)."""

    def __init__(self, path: Path | None, env: Mapping[str, str] | None = None) -> None:
        self.path = path
        self._env = dict(env or {})
        self._found: dict[str, Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self.note: str | None = None  # why there is none

    def known(self) -> dict[str, Any] | None:
        """The kept measurement, if it is of this MLX and this probe."""
        found = self._found
        if found is None and self.path is not None:
            with contextlib.suppress(OSError, ValueError):
                found = json.loads(self.path.read_text())
        if not isinstance(found, dict) or found.get("version") != fit.PROBE_VERSION or found.get("mlx") != mlx_version():
            return None
        self._found = found
        return found

    async def get(self, wait_s: float) -> dict[str, Any] | None:
        """The measurement: the kept one, else one measured now (waited for up to `wait_s`; a
        measurement under way goes on either way, and a later call gets it)."""
        if (found := self.known()) is not None:
            return found
        if self._task is None or self._task.done():
            self.note = "being measured (a few seconds; a first start on a GPU compiles kernels for a minute)"
            self._task = asyncio.create_task(self._measure())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._task), wait_s)
        return self.known()

    async def _measure(self) -> None:
        out = self.path or Path(tempfile.gettempdir()) / f"mlxd-bandwidth-{os.getpid()}.json"
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mlxd.engine.bandwidth", "--out", str(out),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, **self._env})
            stdout, stderr = await asyncio.wait_for(proc.communicate(), PROBE_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            self.note = f"the bandwidth probe did not finish: {exc or type(exc).__name__}"
            log.warning("%s", self.note)
            return
        if proc.returncode != 0:
            tail = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            self.note = f"the bandwidth probe failed (exit {proc.returncode}): {tail[0]}"
            log.warning("%s", self.note)
            return
        with contextlib.suppress(ValueError):
            self._found = json.loads(stdout)
        if self.path is None:
            with contextlib.suppress(OSError):
                out.unlink()
        self.note = None
        found = self._found or {}
        log.info("measured this machine's decode bandwidth: %.1f GB/s (%s)",
                 float(found.get("bandwidth_bytes_s") or 0) / 1e9, found.get("probe"))


class Weights(NamedTuple):
    total: int  # every tensor's bytes
    embedding: int  # the input embedding table's (with its quantization's scales and biases)
    head: bool  # a separate output head (else the table is the head too)
    dtype: str | None  # the dtype most of the bytes are


def weights_of(path: Path) -> Weights:
    """What the model's safetensors headers say of its weights (no tensor is read)."""
    table, head = 0, False
    dtypes: dict[str, int] = {}
    for file in sorted(path.glob("*.safetensors")):
        try:
            header = read_header(file)
        except InspectError:
            continue
        for name, tensor in header.items():
            if not isinstance(tensor, dict):
                continue
            start, end = tensor.get("data_offsets", (0, 0))
            dtypes[str(tensor.get("dtype"))] = dtypes.get(str(tensor.get("dtype")), 0) + int(end) - int(start)
            if "lm_head" in name:
                head = True
            elif "embed_tokens" in name or name.endswith("word_embeddings.weight"):
                table += int(end) - int(start)
    return Weights(sum(dtypes.values()), table, head, max(dtypes, key=lambda d: dtypes[d]).lower() if dtypes else None)


DTYPE_NAMES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def quantization(config: dict[str, Any], stored: str | None) -> str | None:
    """"4-bit" for a quantized model, else its weights' dtype (the config's, else the files')."""
    quant = config.get("quantization") or config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("bits"):
        return f"{quant['bits']}-bit"
    dtype = text_config(config).get("torch_dtype") or config.get("dtype")
    return str(dtype) if dtype else DTYPE_NAMES.get(stored or "", stored)


def model_row(entry: ModelEntry, state: str, budget: int, booked: int, reserved: int, bandwidth: float | None,
              measured: float | None, layer_overhead_s: float = 0.0) -> fit.LibraryModel:
    """One model's library row, the pool booking `booked` bytes for it (`reserved` of them its
    prompt cache); reads its files: run it off the event loop."""
    try:
        config = json.loads((entry.path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    caps = capabilities_of(entry) if config else capabilities({}, set(), None, None)
    text = text_config(config) if isinstance(config, dict) else {}
    per_token = kv_bytes_per_token(text)
    assessed: fit.Fit | None = None
    weights = weights_of(entry.path)
    stored = weights.dtype
    if per_token > 0 or "embedding" in caps.capabilities:
        embedder = "embedding" in caps.capabilities  # no KV, no decoding: memory only
        assessed = fit.assess(weights_bytes=entry.size_bytes + entry.draft_bytes,
                              tensor_bytes=weights.total + entry.draft_bytes if weights.total else None,
                              embedding_bytes=weights.embedding, tied=not weights.head,
                              kv_per_token=0 if embedder else per_token, window=caps.context_window,
                              booked_bytes=booked, reserved_bytes=reserved, budget_bytes=budget,
                              bandwidth_bytes_s=None if embedder else bandwidth,
                              layers=int(text.get("num_hidden_layers") or 0), layer_overhead_s=layer_overhead_s)
        assessed.measured_decode_tps = measured
    return fit.LibraryModel(id=entry.id, path=str(entry.path), source=entry.source, size_bytes=entry.size_bytes,
                            quantization=quantization(config, stored) if isinstance(config, dict) else stored,
                            capabilities=caps.capabilities, state=state, fit=assessed)


def machine(device: str, memory: int, budget: int, found: dict[str, Any] | None, note: str | None) -> fit.Machine:
    """`memory`: what the models live in (RAM; on CUDA the GPU's: engines/footprint.py)."""
    rate = float(found["bandwidth_bytes_s"]) if found and found.get("bandwidth_bytes_s") else None
    return fit.Machine(device=device, memory_bytes=memory, budget_bytes=budget,
                       bandwidth_gbs=round(rate / 1e9, 2) if rate else None,
                       bandwidth_probe=found.get("probe") if found else None,
                       bandwidth_measured_at=found.get("measured_at") if found else None,
                       bandwidth_note=None if found else note)
