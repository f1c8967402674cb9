"""A KV cache laid out for its file: the arrays mlx-lm's `save_prompt_cache` writes, as host buffers.

Two steps, so that a generation checkpoint never makes the GPU thread wait (gpu/checkpoints.py):
`stage` builds the arrays to write (each contiguous, in its own buffer; bfloat16 and bool seen
as the unsigned ints of their bits, which a buffer can hold) without evaluating them, and
`host_tensors` takes the bytes of arrays already evaluated. A checkpoint stages its copy right
behind the step under way (`mx.async_eval`) and takes the bytes a step later, when the GPU has
made them: no new work is queued then, so nothing waits for the step in flight. `tensors_of`
does both at once, evaluating (a write-behind while idle, an eviction, a drain).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxd.engine.cache.kv_files import DTYPES, Tensor

BIT_VIEWS = {mx.bfloat16: mx.uint16, mx.bool_: mx.uint8}  # dtypes without a buffer format


@dataclass(frozen=True, slots=True)
class Staged:
    """A cache's file layout: mlx-lm's metadata (cache classes, which entries are scalars) and
    each tensor's name, dtype and shape with the array its bytes come from."""

    meta: dict[str, str]
    tensors: list[tuple[str, str, tuple[int, ...], mx.array]]

    @property
    def arrays(self) -> list[mx.array]:
        return [a for *_, a in self.tensors]


def stage(kv: list[Any]) -> Staged:
    """`kv` laid out as `save_prompt_cache` lays it out, its arrays lazy (GPU thread)."""
    flat: list[tuple[str, Any]] = tree_flatten([c.state for c in kv])  # type: ignore[assignment]
    tensors: list[tuple[str, str, tuple[int, ...], mx.array]] = []
    scalars: list[tuple[str, str]] = []
    for name, value in flat:
        if isinstance(value, mx.array):
            a = mx.contiguous(value)
        elif isinstance(value, bool | int | float):
            scalars.append((name, "scalar"))
            a = mx.array(value)
        elif isinstance(value, str):
            scalars.append((name, "string"))
            a = mx.array([ord(ch) for ch in value])
        elif value is None:
            scalars.append((name, "none"))
            a = mx.array([])
        else:
            raise ValueError(f"cache state not serializable: {type(value).__name__}")
        dtype = DTYPES[str(a.dtype).removeprefix("mlx.core.")]
        bits = BIT_VIEWS.get(a.dtype)
        tensors.append((name, dtype, tuple(a.shape), a.view(bits) if bits is not None else a))
    meta = {f"1.{i}": type(c).__name__ for i, c in enumerate(kv)}
    meta["2.0"] = ""  # mlx-lm's scalars list starts with an empty string
    for i, (name, kind) in enumerate(scalars, start=1):
        meta[f"2.{i}.0"], meta[f"2.{i}.1"] = name, kind
    return Staged(meta, tensors)


def host_tensors(staged: Staged) -> tuple[dict[str, str], list[Tensor], list[Any]]:
    """The metadata, the tensors as host buffers, and the arrays those buffers point into (keep
    them alive until written). The arrays must be evaluated (or queued: reading one waits for it)."""
    tensors = [Tensor(name, dtype, shape, memoryview(a).cast("B"))  # type: ignore[arg-type]
               for name, dtype, shape, a in staged.tensors]
    return staged.meta, tensors, staged.arrays


def tensors_of(kv: list[Any]) -> tuple[dict[str, str], list[Tensor], list[Any]]:
    """`stage` and `host_tensors` at once, evaluating the arrays (GPU thread)."""
    staged = stage(kv)
    mx.eval(staged.arrays)
    return host_tensors(staged)


SLACK_SHARE = 0.1  # a stored cache whose buffers are this much longer than its tokens is copied tight


def slack(kv: list[Any], offset: int) -> float:
    """How much longer than `offset` tokens the cache's buffers are, as a share of it."""
    c = kv[0]
    keys = getattr(c, "keys", None)
    if type(c) is QuantizedKVCache and keys is not None:
        keys = keys[0]
    length = keys.shape[2] if keys is not None and hasattr(keys, "shape") and keys.ndim == 4 else offset
    return (length - offset) / offset if offset else 0.0


def compact(kv: list[Any]) -> None:
    """Give a cache's arrays their own contiguous buffers (a view of a larger buffer would keep
    all of it alive, and must be copied to be written)."""
    for c in kv:
        if type(c) is KVCache and c.keys is not None:
            c.keys, c.values = mx.contiguous(c.keys), mx.contiguous(c.values)  # type: ignore[arg-type]
        elif type(c) is QuantizedKVCache and c.keys is not None:
            c.keys = tuple(mx.contiguous(x) for x in c.keys)
            c.values = tuple(mx.contiguous(x) for x in c.values)
