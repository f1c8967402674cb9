"""Loading the model onto the GPU thread and making what serves it: the prompt cache and the Runner.

The gateway calls these once, on the GPU thread, before its loop starts. `open_model`'s errors
are load errors (the engine exits with MODEL_LOAD_ERROR); what `make_runner` raises is a dying
GPU thread's.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxd.engine import mlx_env
from mlxd.engine.cache.fingerprint import tier_dir
from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.cache.ssd_tier import SsdTier, default_ssd_cache_bytes
from mlxd.engine.gpu import (
    cpu_attention,
    decode_attention,
    dense_prefill,
    first_pass,
    prefill_attention,
    width_probe,
)
from mlxd.engine.gpu.device_memory import (
    cache_limit_bytes,
    device_kind,
    memory_limit_bytes,
    memory_line,
    prompt_cache_sized,
    release_unused,
    size_for,
)
from mlxd.engine.gpu.flat_rows import FLATTEN_MIN_ROWS, flatten_quantized_rows, wins_here
from mlxd.engine.gpu.kv_quant import activation_dtype, check_quantized_kv
from mlxd.engine.gpu.options import GatewayOptions
from mlxd.engine.gpu.runner import Runner
from mlxd.engine.gpu.stats import Stats
from mlxd.engine.gpu.warmup import wanted, warm_up
from mlxd.engine.models.load_meter import LoadMeter
from mlxd.engine.models.loaded_model import LoadedModel, ModelLoadError, wire_model_memory
from mlxd.engine.spec.drafters import DraftSource, open_draft
from mlxd.protocol.memory import kv_bytes_per_token
from mlxd.protocol.sizing import Sizing, plateau_width, short_memory_hint

log = logging.getLogger("mlxd.engine")


def open_model(load: Callable[[], LoadedModel], opts: GatewayOptions) -> LoadedModel:
    """The model, its memory wired, checked against the options (raises what makes it unusable)."""
    loaded = load()
    wire_model_memory()
    on_gpu = bool(mx.cuda.is_available() or mx.metal.is_available())
    loaded.adapters.merge = opts.adapter_merge == "on" or (opts.adapter_merge == "auto" and on_gpu)
    if opts.kv_bits is not None:
        check_quantized_kv(loaded.config, activation_dtype(loaded.model), opts.kv_bits, opts.kv_group_size)
    loaded.drafts = open_drafts(loaded, opts)
    return loaded


def open_drafts(loaded: LoadedModel, opts: GatewayOptions) -> DraftSource | None:
    """What the model drafts with (spec/drafters.py), its draft model loaded and checked; a draft
    that cannot work is a load error that says why."""
    configs: list[dict[str, Any]] = []

    def load(path: str) -> tuple[Any, Any]:
        try:
            draft = LoadedModel(Path(path), "draft")
        except ModelLoadError as exc:
            raise ValueError(f"the draft model: {exc}") from exc
        configs.append(draft.config)
        return draft.model, draft.tokenizer

    try:
        source = open_draft(opts.draft, loaded.model, loaded.tokenizer, loaded.vocab_size,
                            opts.solo_prefill_step or opts.prefill_step, load)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    if source is None:
        return None
    if configs:  # each row that drafts holds the draft model's KV beside its own, as long
        source.kv_bytes_per_token = kv_bytes_per_token(configs[0])
        log.info("speculative decoding drafts with %s (its KV: %d bytes a token, beside the model's %d)",
                 opts.draft.label, source.kv_bytes_per_token, kv_bytes_per_token(loaded.config))
    else:
        log.info("speculative decoding drafts with %s", opts.draft.label)
    return source


# A prefill chunk while no other row waits for tokens, on a GPU: mlx-lm's own chunk. A lone 1B
# model's 8,000-token prompt took 1.3x less time in these than in 512-token chunks on the H200,
# and 2048-token chunks at aligned positions are the few shapes cuDNN's attention builds once
# (prefill_attention.py). On the CPU a chunk takes seconds: the inbox waits for it.
GPU_SOLO_PREFILL_STEP = 2048


def size_options(loaded: LoadedModel, opts: GatewayOptions) -> tuple[GatewayOptions, Sizing]:
    """The options with the width and KV budget filled in (device_memory.py; at `batch auto` on a
    GPU within what the width probe found paying), and how they were chosen; the solo prefill
    chunk too. Installs the model's batched-decode patches first (the probe runs through them)."""
    opts = asked = prompt_cache_sized(opts)
    if (limit := memory_limit_bytes(opts)) is not None:
        mx.set_memory_limit(limit)
        log.info("MLX queues work within %.1f GiB (what the engine may use, less 3/4 of the sizing's headroom)",
                 limit / 1024**3)
    sizing = size_for(loaded, opts)
    on_gpu = bool(mx.cuda.is_available() or mx.metal.is_available())
    solo = opts.solo_prefill_step or (GPU_SOLO_PREFILL_STEP if on_gpu else opts.prefill_step)
    opts = replace(opts, batch=sizing.width, kv_budget_tokens=sizing.kv_budget_tokens,
                   solo_prefill_step=max(solo, opts.prefill_step))
    patch_model(loaded, opts)
    if sizing.auto and sizing.width > 1 and width_probe.wanted(opts.width_probe):
        try:
            rates, how = width_probe.remembered(opts.probe_dir, loaded.model, loaded.vocab_size, loaded.path,
                                                sizing.width)
        except Exception as exc:  # a measurement: the width memory allows is still a width that works
            log.warning("width probe failed (%s: %s): the width is what memory allows", type(exc).__name__, exc)
        else:
            seen = ", ".join(f"{w}: {rate:.1f}" for w, rate in sorted(rates.items()))
            sizing = size_for(loaded, asked, (plateau_width(rates), f"{how}, tok/s by width {seen}"))
            opts = replace(opts, batch=sizing.width, kv_budget_tokens=sizing.kv_budget_tokens)
    log.info("%s", sizing.why)
    return opts, sizing


def patch_model(loaded: LoadedModel, opts: GatewayOptions) -> None:
    """The model's patches: quantized rows flattened where that wins, long chunks through
    quantized layers dequantized (dense_prefill.py), on CUDA attention through mlxd
    (decode_attention.py, prefill_attention.py), on the CPU batched decode attention on every
    core (cpu_attention.py); its output projection able to make the last position's logits
    alone (first_pass.py: last, as the others change the classes of layers)."""
    assert opts.batch is not None
    if opts.batch >= FLATTEN_MIN_ROWS and wins_here() and (n := flatten_quantized_rows(loaded.model)):
        log.info("%d quantized layers run batched decode rows flattened (from %d rows)", n, FLATTEN_MIN_ROWS)
    # An engine group's ranks run their passes in step: nothing here may run a pass of its own
    # on one rank (first_pass's check), nor decide apart from the others.
    alone = loaded.split is None
    if alone and dense_prefill.enabled() and (n := dense_prefill.install(loaded.model)):
        log.info("%d quantized layers run prefill chunks of %d tokens or more dequantized, through a dense matmul",
                 n, dense_prefill.min_tokens())
    if mx.cuda.is_available() and (modules := decode_attention.install(loaded.model)):
        prefill_attention.aligned_chunk = opts.solo_prefill_step
        log.info("attention runs through mlxd (%s): prefill chunks to cuDNN's or MLX's unfused attention%s",
                 ", ".join(modules), "; batched decode attention runs mlxd's kernel" if decode_attention.enabled() else "")
    elif mx.default_device().type == mx.DeviceType.cpu and (modules := cpu_attention.install(loaded.model)):
        log.info("batched decode attention runs on %d CPU cores (%s)", cpu_attention.cores(), ", ".join(modules))
    if alone and first_pass.install(loaded.model):
        log.info("a prompt's last piece and its first token run as one pass, projecting the last position only")


def make_runner(
    loaded: LoadedModel, stats: Stats, opts: GatewayOptions, sizing: Sizing, meter: LoadMeter, idle: threading.Event
) -> tuple[Runner, PrefixCache]:
    """The warm-up (when wanted), then the Runner and prompt cache (`opts` sized: size_options)."""
    budget = opts.kv_budget_tokens
    assert opts.batch is not None and budget is not None, "size_options fills them in"
    if wanted(opts.warmup):
        if cold := mlx_env.cold_kernel_cache(os.environ, cuda=bool(mx.cuda.is_available())):
            log.info("warm-up: the first start on this machine with this MLX version compiles its GPU kernels "
                     "(about a minute; kept in %s for later starts)", cold)
        # Its own stats and a RAM-only prompt cache: the warm-up's jobs leave no trace.
        warm = Runner(loaded, Stats(), opts, budget, PrefixCache(opts.prompt_cache_bytes))
        seconds, jobs, most = warm_up(warm, loaded, opts.batch, meter)
        log.info("warm-up: %d jobs, up to %d rows at once: %.0f ms (MLX memory: %s)", jobs, most, seconds * 1000,
                 memory_line())
    if (limit := cache_limit_bytes(opts)) is not None:
        log.info("before serving: %s", release_unused())  # what the probe and the warm-up freed
        mx.set_cache_limit(limit)
        log.info("MLX keeps at most %.2f GiB of freed buffers for reuse (%s)", limit / 1024**3,
                 "its CPU default" if device_kind() == "cpu" else "the sizing's headroom")
    # Unseeded sampling draws from MLX's global generator: fresh entropy for each engine.
    mx.random.seed(int.from_bytes(os.urandom(8), "little"))
    cache = PrefixCache(opts.prompt_cache_bytes, ssd_tier(loaded, opts), idle, prefill_cost=stats.prefill_cost)
    return Runner(loaded, stats, opts, budget, cache, short_memory_hint(sizing)), cache


def ssd_tier(loaded: LoadedModel, opts: GatewayOptions) -> SsdTier | None:
    """The SSD tier for this model and KV settings; None when off or its dir is unusable."""
    if opts.ssd_root is None or opts.ssd_cache_bytes == 0 or opts.prompt_cache_bytes == 0:
        return None
    try:
        root = tier_dir(opts.ssd_root, loaded.path, opts.kv_bits, opts.kv_group_size, loaded.split)
        cap = opts.ssd_cache_bytes if opts.ssd_cache_bytes is not None else default_ssd_cache_bytes(root)
        return SsdTier(root, cap)
    except OSError as exc:
        log.warning("SSD prompt cache off: cannot use %s: %s", opts.ssd_root, exc)
        return None
