"""`--width-probe`: how wide a batch still pays on this device, measured at load.

Memory says how many rows fit (protocol/sizing.py); it does not say whether they pay. A decode
step reads the weights once for all its rows, so aggregate tokens/s grows with the width until
the device's compute (or the attention over every row's keys) catches up with that read: on an
H200 a 1B model's grew past 64 rows, on a laptop a 7B model's stops far sooner. Past that point
a wider batch only shares the same tokens/s among more streams, each slower.

The probe runs mlx-lm's BatchGenerator (the batch lane's own decode path, with mlxd's attention
patches already installed) at widths 1, 2, 4, ... up to what memory holds: a short prompt a row,
two untimed steps (a GPU compiles each new shape on first use), then a few timed ones.
protocol.sizing.plateau_width reads the result. `auto` probes on a GPU when the width is
`auto`; a configured width is never probed. On an H200 it took 6-9 s with the kernels
compiled (20-120 s on a machine's first start, compiling them), so what it measured is kept
in the data dir (`probe/`, one small JSON file per model, device, memory cap, version of
mlxd, MLX and mlx-lm, and MLX's settings in the environment) and read back by the next start of the same engine: a model swapped
out and back does not pay it again. Delete the dir to measure again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from mlxd.protocol.sizing import pays

log = logging.getLogger("mlxd.engine")

PROMPT_TOKENS = 32
STABLE_DEVICE_KEYS = ("device_name", "architecture", "total_memory", "memory_size", "max_recommended_working_set_size")
MISSES = 2  # widths in a row that did not pay: the wider ones are not measured
UNTIMED_STEPS = 2
TIMED_STEPS = 4


def wanted(mode: str) -> bool:
    """Whether `--width-probe MODE` (on, off, auto) probes on this machine."""
    if mode == "auto":
        return bool(mx.cuda.is_available() or mx.metal.is_available())
    return mode == "on"


def widths_up_to(cap: int) -> list[int]:
    """1, 2, 4, ... up to `cap`, and `cap` itself."""
    widths, w = [], 1
    while w < cap:
        widths.append(w)
        w *= 2
    return [*widths, cap]


def step_rate(model: Any, vocab_size: int, width: int) -> float:
    """Aggregate decode tokens/s of `width` rows in one batched step (best of TIMED_STEPS)."""
    top = max(3, vocab_size - 1)
    prompts = [[(r * 7919 + i * 104729) % (top - 2) + 1 for i in range(PROMPT_TOKENS)] for r in range(width)]
    gen = BatchGenerator(model, completion_batch_size=width, prefill_batch_size=width,
                         prefill_step_size=width * PROMPT_TOKENS)
    try:
        gen.insert(prompts, max_tokens=[PROMPT_TOKENS + UNTIMED_STEPS + TIMED_STEPS + 8] * width)
        decoding, steps = 0, 0
        while decoding < UNTIMED_STEPS and steps < 10 * UNTIMED_STEPS:  # the prefill, then shapes compiled
            _, responses = gen.next()
            decoding = decoding + 1 if len(responses) == width else 0
            steps += 1
        best = float("inf")
        for _ in range(TIMED_STEPS):
            t0 = time.perf_counter()
            _, responses = gen.next()
            [int(r.token) for r in responses]  # the step's tokens, on the host: the step has run
            best = min(best, time.perf_counter() - t0)
    finally:
        close = getattr(gen, "close", None)
        if close is not None:
            close()
        del gen
        mx.clear_cache()
    return width / best


def measure(model: Any, vocab_size: int, cap: int) -> tuple[dict[int, float], float]:
    """Aggregate decode tokens/s at each probed width up to `cap` (until MISSES in a row did not
    pay), and the seconds it took."""
    t0 = time.perf_counter()
    rates: dict[int, float] = {}
    kept, misses = 0, 0
    for w in widths_up_to(cap):
        rates[w] = step_rate(model, vocab_size, w)
        if not kept or pays(rates, kept, w):
            kept, misses = w, 0
        elif (misses := misses + 1) >= MISSES:
            break
    return rates, time.perf_counter() - t0


def memo_key(model_path: Path, cap: int, environ: Mapping[str, str] = os.environ) -> str:
    """What a measurement depends on: the model's files, the device, the cap, the versions, and
    MLX's settings in the environment (CUDA graphs on or off change the rates)."""
    from mlxd import __version__

    files = sorted((f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in model_path.glob("*.safetensors"))
    config = (model_path / "config.json").read_bytes() if (model_path / "config.json").exists() else b""
    info = {k: v for k, v in mx.device_info().items() if k in STABLE_DEVICE_KEYS}  # not free memory, say
    versions = [__version__, metadata.version("mlx"), metadata.version("mlx-lm")]
    settings = sorted((k, v) for k, v in environ.items() if k.startswith("MLX_") and k != "MLX_PTX_CACHE_DIR")
    parts = [str(model_path.resolve()), files, hashlib.sha256(config).hexdigest(), info, cap, versions,
             PROMPT_TOKENS, TIMED_STEPS, settings]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def remembered(memo_dir: Path | None, model: Any, vocab_size: int, model_path: Path,
               cap: int) -> tuple[dict[int, float], str]:
    """The rates by width, measured now or kept from an earlier start (memo_dir None: always
    measured, nothing kept), and how they were had, for the sizing line."""
    memo = memo_dir / f"{memo_key(model_path, cap)}.json" if memo_dir is not None else None
    if memo is not None:
        try:
            kept = json.loads(memo.read_text())
            return {int(w): float(r) for w, r in kept["rates"].items()}, f"probe kept from {kept['measured']}"
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    rates, seconds = measure(model, vocab_size, cap)
    how = f"probe {seconds:.1f} s"
    if memo is not None:
        try:
            memo_dir.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
            tmp = memo.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"rates": rates, "seconds": round(seconds, 2),
                                       "measured": time.strftime("%Y-%m-%d %H:%M")}))
            tmp.replace(memo)
        except OSError as exc:
            log.warning("width probe: could not keep what it measured in %s: %s", memo_dir, exc)
    return rates, how
