"""What a model is made of, read from its safetensors headers (no mlx, no weights loaded):
parameter count, dtype, size, whether it is quantized, and what each quantization would weigh.

A safetensors file starts with an 8-byte little-endian length and a JSON header naming each
tensor's dtype and shape. The estimate follows mlx-lm's affine quantization: a 2-D weight
whose rows split into whole groups (linear layers, embeddings) becomes `bits` bits per
weight plus a scale and a bias per group, in the weight's own dtype (16 bits each for bf16,
32 for float32); everything else (norms, biases, odd shapes) keeps its dtype.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

DTYPE_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "U32": 32, "I16": 16,
              "U16": 16, "I8": 8, "U8": 8, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8}
MAX_HEADER_BYTES = 100 << 20
BITS = (2, 3, 4, 5, 6, 8)


class Estimate(msgspec.Struct, kw_only=True):
    bits: int
    group_size: int
    bits_per_weight: float
    size_bytes: int


class ModelInspection(msgspec.Struct, kw_only=True):
    object: str = "model.inspection"
    model: str
    path: str
    model_type: str | None
    parameters: int
    dtype: str | None  # the most common dtype of its tensors
    quantized: bool
    quantization: dict[str, Any] | None
    size_bytes: int
    layers: int | None
    context_length: int | None
    estimates: list[Estimate]


class InspectError(Exception):
    """The model's files cannot be read; the message says which and why."""


def read_header(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER_BYTES:
                raise InspectError(f"{path.name}: a header of {length} bytes is not safetensors")
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise InspectError(f"{path.name} cannot be read as safetensors ({exc})") from None
    header.pop("__metadata__", None)
    return header


def inspect_model(model_id: str, path: Path, group_size: int = 64) -> ModelInspection:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InspectError(f"{path} holds no .safetensors files")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    quant = config.get("quantization") or config.get("quantization_config")
    tensors = [(name, t) for f in files for name, t in read_header(f).items()]
    dtypes: Counter[str] = Counter()
    packed_bits = int(quant["bits"]) if isinstance(quant, dict) and quant.get("bits") else None
    params = 0
    sizes = dict.fromkeys(BITS, 0)
    for name, t in tensors:
        shape = t["shape"]
        n = 1
        for d in shape:
            n *= d
        bits = DTYPE_BITS.get(t["dtype"], 16)
        dtypes[t["dtype"]] += n
        if quant:
            if not name.endswith((".scales", ".biases")):  # those are the quantization's own
                params += n * 32 // packed_bits if packed_bits and t["dtype"] == "U32" else n
            continue
        params += n
        quantizable = len(shape) == 2 and shape[-1] % group_size == 0 and name.endswith(".weight")
        for b in BITS:
            sizes[b] += n * b + (n // group_size) * 2 * bits if quantizable else n * bits
    size = sum(f.stat().st_size for f in files)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return ModelInspection(
        model=model_id, path=str(path), model_type=config.get("model_type"), parameters=params,
        dtype=dtypes.most_common(1)[0][0].lower() if dtypes else None, quantized=bool(quant),
        quantization=quant if isinstance(quant, dict) else None, size_bytes=size,
        layers=text.get("num_hidden_layers"), context_length=text.get("max_position_embeddings"),
        estimates=[] if quant else [
            Estimate(bits=b, group_size=group_size, bits_per_weight=round(sizes[b] / max(1, params), 3),
                     size_bytes=sizes[b] // 8) for b in BITS])
