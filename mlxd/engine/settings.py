"""The engine's command line, parsed into one value."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from mlxd.engine.spec.config import DEFAULT_NUM_DRAFT_TOKENS
from mlxd.protocol.process import DEFAULT_CHECKPOINT_TOKENS
from mlxd.protocol.sampling import Defaults
from mlxd.protocol.sizing import parse_batch
from mlxd.protocol.speculation import parse_draft

DEFAULT_MAX_BODY = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class EngineSettings:
    model: Path
    model_id: str
    socket: Path
    max_context: int | None = None
    batch: int | None = 1  # None: auto (protocol/sizing.py)
    memory_bytes: int | None = None  # what the engine sizes itself within (None: the device's memory)
    prefill_step: int = 512
    solo_prefill_step: int | None = None  # None: 2048 on a GPU, prefill_step on the CPU
    kv_budget_tokens: int | None = None
    warmup: str = "auto"
    width_probe: str = "auto"
    gather_ms: float = 5.0
    max_body: int = DEFAULT_MAX_BODY
    parent_pid: int | None = None
    prompt_cache_bytes: int | None = None  # None: protocol.memory's default for this machine
    ssd_cache_bytes: int | None = None  # None: default_ssd_cache_bytes; 0: no SSD tier
    ssd_cache_dir: Path | None = None  # None: <data dir>/kv
    kv_bits: int | None = None
    kv_group_size: int = 64
    write_behind: bool = True
    generation_checkpoint: int = DEFAULT_CHECKPOINT_TOKENS  # a running row's KV to SSD every N tokens; 0: never
    adapter_merge: str = "auto"
    draft: str = "none"
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    defaults: Defaults | None = None  # what requests that set none get (mlxd's config: [defaults])
    group_control: str | None = None  # one rank of an engine group: rank 0's control socket, a path or tcp://IP:PORT
    group_backend: str = "ring"  # mx.distributed's backend for the group
    group_mode: str = "tensor"  # how the model is split: tensor or pipeline
    group_heartbeat_s: float = 10.0  # a rank not heard from this long ends the group
    group_turn_timeout_s: float = 120.0  # a turn some rank has not finished this long ends it


def batch_value(text: str) -> int | None:
    """`--batch`: a width of at least 1, or `auto` (None)."""
    try:
        return parse_batch(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of at least 1 or auto, not {text!r}") from None


def parse_args(argv: list[str]) -> EngineSettings:
    """Parse `python -m mlxd.engine` arguments (argparse exits 2 on bad ones)."""
    p = argparse.ArgumentParser(prog="python -m mlxd.engine", description="Serve one MLX model on a Unix socket.")
    p.add_argument("--model", required=True, type=Path, help="MLX model dir")
    p.add_argument("--model-id", required=True, help="the model's id in the API")
    p.add_argument("--socket", required=True, type=Path, help="Unix socket path (its dir must be 0700)")
    p.add_argument("--max-context", type=int, default=None, help="cap the context window (tokens)")
    p.add_argument(
        "--batch", type=batch_value, default=1,
        help="max sequences decoding at once (1: one at a time; auto: as many as memory and the device suit)",
    )
    p.add_argument(
        "--memory-bytes", type=int, default=None,
        help="the memory the engine sizes its batch and KV budget within (default: the device's: Metal's "
             "recommended working set, the CUDA device's memory, 75%% of RAM on CPU)",
    )
    p.add_argument("--prefill-step", type=int, default=512,
                   help="prompt tokens per prefill chunk while other rows decode; cancellation is checked between chunks")
    p.add_argument("--solo-prefill-step", type=int, default=None,
                   help="prompt tokens per prefill chunk while no other row decodes (default: 2048 on a GPU, "
                        "--prefill-step on the CPU)")
    p.add_argument(
        "--kv-budget-tokens", type=int, default=None,
        help="KV cache tokens the running sequences may book in all (default: the whole context window, and "
             "4096 a row past it, within the memory left after the weights)",
    )
    p.add_argument(
        "--warmup", choices=("auto", "on", "off"), default="auto",
        help="run warm-up jobs through the lanes at load, compiling their kernels (auto: on CUDA only)",
    )
    p.add_argument(
        "--adapter-merge", choices=("auto", "on", "off"), default="auto",
        help="run an adapter stack that has every row to itself on a merged copy of its layers (as fast as the "
             "base model, for that copy's memory; auto: on a GPU)",
    )
    p.add_argument(
        "--draft", default="none", metavar="none|ngram|self:N|DIR",
        help="speculative decoding: drafted tokens the model checks in one pass (greedy output is unchanged). "
             "ngram: copied from the request's own context (prompt lookup); self:N: the model's own first N "
             "layers and its head; DIR: a small draft model of the same tokenizer (none: off)",
    )
    p.add_argument("--num-draft-tokens", type=int, default=DEFAULT_NUM_DRAFT_TOKENS,
                   help="the most drafted tokens one pass checks (the length adapts to what is accepted)")
    p.add_argument(
        "--width-probe", choices=("auto", "on", "off"), default="auto",
        help="with --batch auto, measure decode throughput at widths 1, 2, 4, ... at load and go no wider than "
             "it still grows (auto: on a GPU)",
    )
    p.add_argument(
        "--gather-ms", type=float, default=5.0,
        help="after requests have come in together, one finding the engine idle waits up to this long for "
             "the rest of its burst, so they are prefilled as one batch (0: never wait)",
    )
    p.add_argument("--max-body", type=int, default=DEFAULT_MAX_BODY, help="max request body bytes")
    p.add_argument(
        "--prompt-cache-bytes", type=int, default=None,
        help="RAM for cached prompt prefixes' KV (default: 10%% of memory, 512 MiB to 32 GiB; 0: no prompt cache)",
    )
    p.add_argument(
        "--ssd-cache-bytes", type=int, default=None,
        help="disk for the prompt cache's SSD tier (default: 25%% of the free space, at most 32 GiB; 0: no SSD tier)",
    )
    p.add_argument("--ssd-cache-dir", type=Path, default=None, help="the SSD tier's root (default: <data dir>/kv)")
    p.add_argument(
        "--kv-bits", type=int, choices=(2, 3, 4, 5, 6, 8), default=None,
        help="quantize the KV cache to this many bits (mlx-lm's QuantizedKVCache); runs one sequence at a time",
    )
    p.add_argument("--kv-group-size", type=int, choices=(32, 64, 128), default=64, help="group size for --kv-bits")
    p.add_argument(
        "--ssd-write-behind", choices=("on", "off"), default="on",
        help="write new prompt-cache entries to SSD while idle (off: only drains, evictions and stops write)",
    )
    p.add_argument(
        "--generation-checkpoint", type=int, default=DEFAULT_CHECKPOINT_TOKENS, metavar="N",
        help="write a running reply's KV (prompt and output) to the SSD tier every N tokens, so a reply "
             "continued after a crash prefills fewer than N tokens (0: never)",
    )
    p.add_argument("--defaults", default=None, metavar="JSON",
                   help='what a request that sets none gets, over the model\'s generation_config.json: a JSON '
                        'object of temperature, top_p, top_k, min_p, max_tokens, thinking (mlxd\'s [defaults])')
    p.add_argument("--group-control", default=None, metavar="PATH|tcp://IP:PORT",
                   help="run as one rank of an engine group (its rank and peers from MLX_RANK and MLX_HOSTFILE, "
                        "or the backend's own variables): rank 0 serves and listens here for the other ranks, "
                        "which replay its turns; over TCP each proves itself with $MLXD_GROUP_TOKEN "
                        "(docs/distributed.md)")
    p.add_argument("--group-backend", choices=("ring", "nccl", "mpi"), default="ring",
                   help="mx.distributed's backend for the group")
    p.add_argument("--group-mode", choices=("tensor", "pipeline"), default="tensor",
                   help="split the model's weights (tensor) or its layers (pipeline) over the ranks")
    p.add_argument("--group-heartbeat", type=float, default=10.0, metavar="SECONDS",
                   help="end the group when a rank has sent no heartbeat this long (stopped, or its host gone)")
    p.add_argument("--group-turn-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="end the group when a turn of the GPU loop has not finished on every rank this long "
                        "(a rank hung)")
    default_parent = os.environ.get("MLXD_PARENT_PID")
    p.add_argument(
        "--parent-pid", type=int, default=int(default_parent) if default_parent else None,
        help="exit when this process is no longer our parent (default: the parent at start)",
    )
    a = p.parse_args(argv)
    for name in ("max_context", "prefill_step", "solo_prefill_step", "kv_budget_tokens", "max_body", "memory_bytes"):
        value = getattr(a, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        kind, _, draft_dir = parse_draft(a.draft)
    except ValueError as exc:
        p.error(f"--draft: {exc}")
    if kind == "model":  # a dir that is not a model is a load error (the supervisor shows those)
        a.draft = str(Path(draft_dir).expanduser())
    if not 1 <= a.num_draft_tokens <= 64:
        p.error("--num-draft-tokens must be between 1 and 64")
    if not 0 <= a.gather_ms <= 1000:
        p.error("--gather-ms must be between 0 and 1000")
    defaults = None
    if a.defaults is not None:
        try:
            defaults = msgspec.json.decode(a.defaults, type=Defaults)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            p.error(f"--defaults: {exc}")
    if a.group_heartbeat <= 0 or a.group_turn_timeout <= 0:
        p.error("--group-heartbeat and --group-turn-timeout must be > 0")
    if a.generation_checkpoint < 0:
        p.error("--generation-checkpoint must be >= 0")
    for name in ("prompt_cache_bytes", "ssd_cache_bytes"):
        value = getattr(a, name)
        if value is not None and value < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    return EngineSettings(
        model=a.model, model_id=a.model_id, socket=a.socket, max_context=a.max_context,
        batch=a.batch, memory_bytes=a.memory_bytes, prefill_step=a.prefill_step,
        solo_prefill_step=a.solo_prefill_step, kv_budget_tokens=a.kv_budget_tokens, warmup=a.warmup, width_probe=a.width_probe,
        gather_ms=a.gather_ms, max_body=a.max_body, parent_pid=a.parent_pid,
        prompt_cache_bytes=a.prompt_cache_bytes, ssd_cache_bytes=a.ssd_cache_bytes, ssd_cache_dir=a.ssd_cache_dir,
        kv_bits=a.kv_bits, kv_group_size=a.kv_group_size, write_behind=a.ssd_write_behind == "on",
        generation_checkpoint=a.generation_checkpoint,
        adapter_merge=a.adapter_merge, draft=a.draft, num_draft_tokens=a.num_draft_tokens, defaults=defaults,
        group_control=a.group_control, group_backend=a.group_backend, group_mode=a.group_mode,
        group_heartbeat_s=a.group_heartbeat, group_turn_timeout_s=a.group_turn_timeout,
    )
