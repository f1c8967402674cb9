"""The GPU gateway's options (from the engine's command line: server.gateway_options)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mlxd.engine.spec.config import DraftConfig


@dataclass(frozen=True, slots=True)
class GatewayOptions:
    prefill_step: int = 512  # prompt tokens per prefill chunk while other rows decode (fair to them)
    solo_prefill_step: int = 0  # ... while none does (0: at load, GPU_SOLO_PREFILL_STEP on a GPU, else prefill_step)
    batch: int | None = 1  # sequences at once; 1 keeps to the serial lane; None: auto (sizing.py)
    memory_bytes: int | None = None  # what the width and KV budget are sized within (None: the device's)
    max_context: int | None = None
    kv_budget_tokens: int | None = None  # None: protocol.sizing's, for the window, width and memory
    width_probe: str = "auto"  # with batch auto, measure where wider stops paying: on, off, auto (a GPU); width_probe.py
    probe_dir: Path | None = None  # where the width probe keeps what it measured (None: nowhere)
    warmup: str = "auto"  # run warm-up jobs through the lanes at load: on, off, auto (CUDA only); warmup.py
    gather_ms: float = 5.0  # in a burst, an idle engine waits this long for the next arrival (0: never)
    prompt_cache_bytes: int = 512 * 1024 * 1024  # the prompt cache's RAM tier (0: no prompt cache)
    prompt_cache_auto: bool = False  # ... is the default (10% of RAM): on CUDA, at most 10% of the GPU's (device_memory.py)
    ssd_root: Path | None = None  # the SSD tier's root (its dir is root/<fingerprint>); None: no SSD tier
    ssd_cache_bytes: int | None = None  # None: default_ssd_cache_bytes
    kv_bits: int | None = None  # quantized KV (the serial lane only: batch must be 1)
    kv_group_size: int = 64
    write_behind: bool = True  # idle: write new entries to SSD (off: drains, evictions and stops only)
    generation_checkpoint: int = 0  # a running row's KV to SSD every this many tokens (0: never); checkpoints.py
    adapter_merge: str = "auto"  # a stack with every row to itself runs merged: on, off, auto (a GPU); adapter_bank.py
    draft: DraftConfig = field(default_factory=DraftConfig)  # speculative decoding's drafts (spec/): none, ngram
