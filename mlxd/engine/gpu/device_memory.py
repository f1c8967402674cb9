"""The device an engine runs on and the memory it may size itself within (protocol/sizing.py).

Read once, at load, on the GPU thread: Metal's recommended working set on macOS, the CUDA
device's memory, 75% of RAM on the CPU (the pool's default budget share). The supervisor's
`--memory-bytes` (its budget) bounds each; the weights are what MLX holds once they are loaded (a
draft model's among them), and a budgeted token costs the model's KV and a draft model's.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import replace

import mlx.core as mx
import psutil

from mlxd.engine.gpu.cuda_memory import cuda_memory, cuda_memory_line, trim_pool
from mlxd.engine.gpu.options import GatewayOptions
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.protocol.memory import default_prompt_cache_bytes, kv_bytes_per_token, text_config
from mlxd.protocol.sizing import Device, Sizing, headroom_bytes, kv_memory_tokens, size_engine

log = logging.getLogger("mlxd.engine")
CPU_MEMORY_SHARE = 0.75  # of RAM, on the CPU: [pool] memory_fraction's default
CPU_CACHE_BYTES = 32 * 1024**2  # MLX's cache of freed buffers on the CPU (its default): cache_limit_bytes


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


def size_for(loaded: LoadedModel, opts: GatewayOptions, probed: tuple[int, str] | None = None) -> Sizing:
    """The width (`--batch`, or auto's choice, within `probed`'s: width_probe.py) and KV budget
    for this model on this device."""
    device = device_kind()
    memory = allowed_memory_bytes(device, opts)
    tokens = kv_memory_tokens(memory, weights_bytes(loaded), opts.prompt_cache_bytes, token_kv_bytes(loaded))
    return size_engine(width=opts.batch, context=loaded.context_window, memory_tokens=tokens, device=device,
                       kv_budget_tokens=opts.kv_budget_tokens, probed=probed)


def token_kv_bytes(loaded: LoadedModel) -> int:
    """The KV one budgeted token costs: the model's, and a draft model's beside it (its rows
    hold a draft KV as long as their own; a self-draft writes in the model's, n-grams need none)."""
    draft = loaded.drafts.kv_bytes_per_token if loaded.drafts is not None else 0
    return kv_bytes_per_token(text_config(loaded.config)) + draft


def cache_limit_bytes(opts: GatewayOptions) -> int | None:
    """What MLX may keep of freed buffers for reuse: on a GPU the sizing's headroom (None: memory
    unknown), on the CPU CPU_CACHE_BYTES.

    On a GPU MLX keeps freed buffers by default up to its memory limit, so an engine that once
    ran a wide warm-up or a long prefill holds that peak for good. Another engine of the pool,
    or any other program, then finds the device full (on the H200, a raw mlx-lm process beside
    an engine at `batch auto` with an 8B model ran out of memory).

    On the CPU MLX's cache reuses a buffer only for a request of nearly its size, while the C
    allocator reuses freed memory for any size. A batch's KV changes size whenever a row joins or
    leaves, so a large cache held gigabytes of stale sizes while each new array took fresh pages
    from the kernel, which zeroes them: the step after rows left or joined took 1-10 s on the
    2-core CPU (docs/benchmarks.md, "Ninth session"). MLX's own CPU default is kept.
    """
    device = device_kind()
    if device == "cpu":
        return CPU_CACHE_BYTES
    memory = allowed_memory_bytes(device, opts)
    return None if memory is None else headroom_bytes(memory)


def memory_limit_bytes(opts: GatewayOptions, device: Device | None = None) -> int | None:
    """The point at which MLX stops queueing work until finished work frees memory
    (`mx.set_memory_limit`): on an NVIDIA GPU, what the engine may use less three quarters of the
    sizing's headroom (None elsewhere: MLX's own limit stays).

    MLX queues a forward pass ahead of the GPU, and each queued operation's buffers live until
    the GPU is done with them, so a long batched prefill holds what MLX lets it queue: its limit,
    plus the one operation that crossed it. MLX's default limit is 95% of the card, and the card
    holds more than MLX counts: the CUDA context, cuBLAS's and cuDNN's workspaces, the fragments
    of the memory pool behind MLX's allocations, other processes (a spare engine, another model's
    engine). On an H100 80GB an 8B model prefilling 8 rows of 4,574 tokens took MLX to 75.6 GiB
    and the pool to 78.0 of the card's 79.2 GiB, and the next allocation failed
    (docs/benchmarks.md, issue 29). The sizing books the KV budget up to the headroom, so a
    quarter of it is left for a full budget's step to run unthrottled, and three quarters for
    what MLX does not count and the operation beyond the limit (prefill_attention.py keeps the
    largest within SCORES_BLOCK_BYTES). `--memory-bytes` bounds it like the sizing, so engines
    sharing a GPU stay within their shares."""
    device = device or device_kind()
    if device != "cuda" or (memory := allowed_memory_bytes(device, opts)) is None:
        return None
    limit = memory - headroom_bytes(memory) * 3 // 4
    return limit if limit > 0 else None  # a budget smaller than the headroom: MLX's own limit stays


def prompt_cache_sized(opts: GatewayOptions, device: Device | None = None) -> GatewayOptions:
    """The prompt cache's RAM tier where it was not configured: its default is 10% of the host's
    RAM, but on an NVIDIA GPU its entries live in the GPU's memory, so there it is at most 10% of
    what the engine may use of that (`--memory-bytes` bounds it): an RTX 4090's 24 GB beside 256
    GB of RAM would give a 14B 8-bit model no room for KV."""
    device = device or device_kind()
    if not opts.prompt_cache_auto or device != "cuda" or (memory := allowed_memory_bytes(device, opts)) is None:
        return opts
    return replace(opts, prompt_cache_bytes=min(opts.prompt_cache_bytes, default_prompt_cache_bytes(memory)))


def allowed_memory_bytes(device: Device, opts: GatewayOptions) -> int | None:
    """The device's memory, within the supervisor's `--memory-bytes` (None: not known)."""
    memory = device_memory_bytes(device)
    if opts.memory_bytes is not None:
        memory = opts.memory_bytes if memory is None else min(memory, opts.memory_bytes)
    return memory


def release_unused(failure: BaseException | None = None) -> str:
    """After a peak or a failure: MLX's cache of freed buffers and the CUDA pool's unused memory go
    back to the device (cuda_memory.trim_pool); what was released, for a log line (it never raises:
    it runs on failure paths). After a failed step (`failure`, caught) the frames of its traceback
    are cleared first: they hold the step's arrays and the generator that made them."""
    if failure is not None:
        traceback.clear_frames(failure.__traceback__)
    cached = mx.get_cache_memory()
    try:
        mx.clear_cache()
        trimmed = trim_pool() if device_kind() == "cuda" else None
    except RuntimeError as exc:  # after a sticky CUDA error MLX's frees fail too: say so, never raise
        return f"could not release MLX's cache: {exc}"
    return f"released {cached / 1024**3:.1f} GiB of MLX's cache" + (
        f" and {trimmed / 1024**3:.1f} GiB of the CUDA pool's" if trimmed is not None else "")


def memory_line() -> str:
    """MLX's memory now, in GiB: in use, cached for reuse, the peak so far; on CUDA also what the
    driver says of the card and its memory pool (cuda_memory.py)."""
    gib = 1024**3
    return (f"active {mx.get_active_memory() / gib:.1f} GiB, cache {mx.get_cache_memory() / gib:.1f} GiB, "
            f"peak {mx.get_peak_memory() / gib:.1f} GiB"
            + (cuda_memory_line(cuda_memory()) if device_kind() == "cuda" else ""))
