"""An SSD tier file back into an mlx-lm KV cache, read once.

mlx-lm's `load_prompt_cache` reads a file lazily (`mx.load`): after `kv_files.verify` had read
it whole for the checksum, the first step on the restored cache read it a second time. Here
one pass both checks the checksum and fills the arrays; the cache objects are then built the
way `load_prompt_cache` builds them (its metadata: cache classes, which entries are scalars).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
import numpy as np
from mlx.utils import tree_unflatten

from mlxd.engine.cache import kv_files
from mlxd.engine.cache.kv_files import CorruptFile

# safetensors dtype -> (numpy dtype of the bytes, the MLX dtype to view them as, if different)
_DTYPES: dict[str, tuple[Any, Any]] = {
    "BOOL": (np.uint8, mx.bool_), "U8": (np.uint8, None), "I8": (np.int8, None), "U16": (np.uint16, None),
    "I16": (np.int16, None), "U32": (np.uint32, None), "I32": (np.int32, None), "U64": (np.uint64, None),
    "I64": (np.int64, None), "F16": (np.float16, None), "BF16": (np.uint16, mx.bfloat16),
    "F32": (np.float32, None),
}


def _array(_name: str, dtype: str, shape: list[int], data: memoryview) -> mx.array:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype} is not one a KV cache holds")
    np_dtype, view_as = _DTYPES[dtype]
    host = np.frombuffer(data, dtype=np_dtype).reshape(shape)
    a = mx.array(host)  # a copy: `data` is reused
    return a.view(view_as) if view_as is not None else a


def load_cache(path: Path) -> list[Any]:
    """The file's KV cache (a list of mlx-lm cache objects), its checksum checked while
    reading; CorruptFile if the file is damaged or not a cache mlx-lm can rebuild."""
    header, arrays = kv_files.read_verified(path, _array)
    mx.eval(list(arrays.values()))
    try:
        _user, classes, scalars = tree_unflatten(list(header.metadata.items()))
        state: dict[str, Any] = dict(arrays)
        for pos, kind in scalars[1:]:
            a = state[pos]
            if kind == "scalar":
                state[pos] = a.item()
            elif kind == "string":
                state[pos] = "".join(chr(i) for i in a.tolist())
            elif kind == "none":
                state[pos] = None
            else:
                raise ValueError(f"unknown scalar kind {kind!r}")
        layers = tree_unflatten(list(state.items()))
        cache = []
        for cls_name, layer in zip(classes, layers, strict=True):
            cls = getattr(mlx_cache, cls_name, None)
            if not (isinstance(cls, type) and issubclass(cls, mlx_cache._BaseCache)):
                raise ValueError(f"unknown cache class {cls_name!r}")
            cache.append(cls.from_state(layer))
    except CorruptFile:
        raise
    except Exception as exc:  # whatever a well-checksummed but unbuildable file raises
        raise CorruptFile(f"not a cache mlx-lm can rebuild: {type(exc).__name__}: {exc}") from exc
    return cache
