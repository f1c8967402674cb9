"""A KV cache laid out for its file: the arrays mlx-lm's `save_prompt_cache` writes, as host buffers.

Two steps, so that a generation checkpoint never makes the GPU thread wait (gpu/checkpoints.py):
`stage` builds the arrays to write (each tensor contiguous; bfloat16 and bool seen as the
unsigned ints of their bits, which a buffer can hold; on CUDA, like tensors joined into blocks,
so the host reads a file in a few moves) without evaluating them, and `host_tensors` takes the
bytes of arrays already evaluated. A checkpoint stages its copy right behind the step under way
(`mx.async_eval`) and takes the bytes a step later, when the GPU has made them: no new work is
queued then, so nothing waits for the step in flight. `tensors_of` does both at once,
evaluating (a write-behind while idle, an eviction, a drain)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxd.engine.cache.kv_files import DTYPES, Tensor

BIT_VIEWS = {mx.bfloat16: mx.uint16, mx.bool_: mx.uint8}  # dtypes without a buffer format


@dataclass(frozen=True, slots=True)
class Staged:
    """A cache's file layout: mlx-lm's metadata (cache classes, which entries are scalars), each
    tensor's name, dtype and shape, and where its bytes lie: (block, byte offset, byte count) in
    `blocks`, the arrays made for them."""

    meta: dict[str, str]
    tensors: list[tuple[str, str, tuple[int, ...], tuple[int, int, int]]]
    blocks: list[mx.array]
    host: list[Any] | None = None  # instead, on CUDA: each block's bytes on their way to page-locked memory (pinned.py)

    @property
    def arrays(self) -> list[mx.array]:
        return self.blocks


# On CUDA, MLX moves a buffer to managed memory (cudaMallocManaged, then a synchronous copy,
# the GIL held) the first time the host reads it. So there small tensors go into blocks of like
# ones (same dtype and trailing shape), up to BLOCK_BYTES each: few moves a file, none long.
# Elsewhere (Metal's unified memory, the CPU) a host read costs nothing, and a tensor already
# contiguous is taken as it is.
GROUP = bool(mx.cuda.is_available())
BLOCK_BYTES = 32 * 1024 * 1024


def stage(kv: list[Any], group: bool | None = None, block_bytes: int | None = None) -> Staged:
    """`kv` laid out as `save_prompt_cache` lays it out, its arrays lazy (GPU thread); in
    blocks of like arrays of up to `block_bytes` (BLOCK_BYTES) where `group` (GROUP)."""
    flat: list[tuple[str, Any]] = tree_flatten([c.state for c in kv])  # type: ignore[assignment]
    arrays: list[tuple[str, str, mx.array]] = []
    scalars: list[tuple[str, str]] = []
    for name, value in flat:
        if isinstance(value, mx.array):
            a = value
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
        arrays.append((name, dtype, a.view(bits) if bits is not None else a))
    meta = {f"1.{i}": type(c).__name__ for i, c in enumerate(kv)}
    meta["2.0"] = ""  # mlx-lm's scalars list starts with an empty string
    for i, (name, kind) in enumerate(scalars, start=1):
        meta[f"2.{i}.0"], meta[f"2.{i}.1"] = name, kind
    if not (GROUP if group is None else group):
        return Staged(meta, [(name, dtype, tuple(a.shape), (i, 0, a.nbytes)) for i, (name, dtype, a) in enumerate(arrays)],
                      [mx.contiguous(a) for *_, a in arrays])
    # like arrays (dtype, shape past the first axis) joined along their first axis: the join's
    # C-order bytes are each one's C-order bytes in turn
    limit = BLOCK_BYTES if block_bytes is None else block_bytes
    kinds: dict[tuple[Any, tuple[int, ...]], list[list[int]]] = {}
    for i, (_, _, a) in enumerate(arrays):
        runs = kinds.setdefault((a.dtype, tuple(a.shape[1:]) if a.ndim else ()), [[]])
        if runs[-1] and sum(arrays[j][2].nbytes for j in runs[-1]) + a.nbytes > limit:
            runs.append([])
        runs[-1].append(i)
    where: dict[int, tuple[int, int, int]] = {}
    blocks: list[mx.array] = []
    for members in (run for runs in kinds.values() for run in runs):
        at = 0
        for i in members:
            where[i] = (len(blocks), at, arrays[i][2].nbytes)
            at += arrays[i][2].nbytes
        parts = [arrays[i][2] if arrays[i][2].ndim else arrays[i][2].reshape(1) for i in members]
        blocks.append(mx.concatenate(parts, axis=0) if len(parts) > 1 else mx.contiguous(parts[0]))
    return Staged(meta, [(name, dtype, tuple(a.shape), where[i]) for i, (name, dtype, a) in enumerate(arrays)], blocks)


def host_tensors(staged: Staged, read: list[memoryview] | None = None) -> tuple[dict[str, str], list[Tensor], list[Any]]:
    """The metadata, the tensors as host buffers, and the arrays those buffers point into (keep
    them alive until written). The arrays must be evaluated (or queued: reading one waits for it).
    `read`: the first blocks' host buffers, taken already; with `staged.host`, none is read here."""
    if staged.host is not None:
        read = [c.bytes for c in staged.host]  # the writer waits for them first (pinned.wait)
    views = [*(read or []), *(memoryview(b).cast("B") for b in staged.blocks[len(read or []):])]  # type: ignore[arg-type]
    tensors = [Tensor(name, dtype, shape, views[block][start:start + n])
               for name, dtype, shape, (block, start, n) in staged.tensors]
    return staged.meta, tensors, staged.blocks


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


def cache_nbytes(kv: list[Any]) -> int:
    return sum(int(c.nbytes) for c in kv)


def is_trimmable(kv: list[Any]) -> bool:
    return all(c.is_trimmable() for c in kv)


def view(kv: list[Any], n: int) -> list[Any]:
    """A new cache holding the first `n` tokens of `kv`, sharing its arrays (sliced).

    The lane that gets it appends by writing a new buffer (its arrays are exactly `n` long), so
    `kv` is never written to. Other cache kinds are deep-copied, then trimmed.
    """
    out: list[Any] = []
    for c in kv:
        v: Any
        if type(c) is KVCache:
            v = KVCache()
            if c.keys is not None:
                keys: Any = c.keys
                v.keys, v.values = keys[..., :n, :], c.values[..., :n, :]  # type: ignore[index]
            v.offset = n
        elif type(c) is QuantizedKVCache:
            v = QuantizedKVCache(group_size=c.group_size, bits=c.bits)
            if c.keys is not None:
                v.keys = tuple(x[..., :n, :] for x in c.keys)
                v.values = tuple(x[..., :n, :] for x in c.values)
            v.offset = n
        else:
            v = copy.deepcopy(c)
            if (size := v.size()) > n:
                v.trim(size - n)
        out.append(v)
    return out


def after(kv: list[Any], start: int, n: int) -> list[Any]:
    """New caches holding tokens `start` to `n` of `kv` (plain KVCaches), sharing its arrays (sliced)."""
    out = []
    for c in kv:
        v = KVCache()
        v.keys, v.values = c.keys[..., start:n, :], c.values[..., start:n, :]
        v.offset = n - start
        out.append(v)
    return out
