"""An engine's batch width and KV budget, from the memory it may use and the model.

One rule, read by the engine (which sizes itself with it at load) and the supervisor's pool
(which books the memory before the engine starts). Pure arithmetic: the caller measures the
memory (Metal's recommended working set on macOS, the CUDA device's memory, RAM on CPU).

- The KV budget covers the model's whole context window (or `max_context`), and at least
  ROW_TOKENS for each row of the batch, so a prompt that fits the window and the machine is
  never refused by a fixed cap.
- `batch = "auto"` (the width None here) takes the widest batch, up to the device's cap, whose
  budget fits the memory left for KV: what remains after the weights, the prompt cache's RAM
  tier and a headroom for activations; and, where the engine probed it (a GPU), no wider than
  aggregate decode throughput still grows (plateau_width).
- Nothing is over-committed: a budget that memory cannot hold is clamped to what it can (then
  longer prompts are refused, with a message that says what to change), even when the width
  or `max_context` was configured. A configured KV budget is taken as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from mlxd.protocol.memory import ROW_TOKENS

Device = Literal["cpu", "metal", "cuda"]

# The widest batch `auto` picks on each device (a GPU's engine also probes where throughput stops
# growing, below it): on an H200 a 1B model gained up to 64 rows and beyond (docs/benchmarks.md),
# a CPU has few cores to share.
AUTO_WIDTH_CAP: dict[Device, int] = {"cpu": 32, "metal": 64, "cuda": 128}
UNKNOWN_MEMORY_WIDTH = 8  # `auto` when the memory is not known: mlxd's width before `auto`
HEADROOM_SHARE = 0.10  # of the memory: activations, a prefill's working set, the allocator's slack
MIN_HEADROOM = 512 * 1024**2
GIB = 1024**3
# A doubling of the width must add this much aggregate decode tokens/s to be worth making every
# stream slower (the probe's rule, plateau_width); never below PROBE_FLOOR rows (concurrency).
PROBE_GAIN = 1.10
PROBE_FLOOR = 8


@dataclass(frozen=True, slots=True)
class Sizing:
    width: int  # rows decoded at once (`--batch`)
    kv_budget_tokens: int  # KV the running rows may book in all
    memory_tokens: int | None  # the KV tokens the memory left holds (None: not known)
    why: str  # for the log, `mlxd ps` and /admin/engines
    kv_configured: bool = False  # the KV budget was given (--kv-budget-tokens), not derived
    auto: bool = False  # the width was auto's choice (a probe may narrow it), not configured

    @property
    def is_clamped(self) -> bool:
        """Whether memory, not the window or the width, set the budget."""
        return self.memory_tokens is not None and self.kv_budget_tokens == self.memory_tokens


def kv_memory_tokens(memory_bytes: int | None, weights_bytes: int, prompt_cache_bytes: int,
                     kv_bytes_per_token: int) -> int | None:
    """The KV tokens that fit beside the weights, the prompt cache and the headroom (None when
    the memory, or a token's size, is not known)."""
    if memory_bytes is None or kv_bytes_per_token <= 0:
        return None
    room = memory_bytes - weights_bytes - prompt_cache_bytes - headroom_bytes(memory_bytes)
    return max(0, room) // kv_bytes_per_token


def headroom_bytes(memory_bytes: int) -> int:
    """What the sizing leaves for activations, a prefill's working set and the allocator's
    cache of freed buffers (the engine caps MLX's cache at it)."""
    return max(MIN_HEADROOM, int(memory_bytes * HEADROOM_SHARE))


def wanted_tokens(context: int, width: int) -> int:
    """The budget `width` rows want: one whole context, or ROW_TOKENS a row if that is more."""
    return max(context, width * min(context, ROW_TOKENS))


def parse_batch(text: str) -> int | None:
    """`--batch`'s value: a width of at least 1, or `auto` (None); ValueError otherwise."""
    if text.strip().lower() == "auto":
        return None
    width = int(text)
    if width < 1:
        raise ValueError(f"batch must be at least 1 or auto, not {width}")
    return width


def plateau_width(rates: dict[int, float], floor: int = PROBE_FLOOR) -> int:
    """The width past which aggregate decode tokens/s (`rates`, by width) stops growing.

    Widths are taken in order; one is kept when it beats the last kept by PROBE_GAIN per
    doubling (a width that is not a power of two is judged pro rata). A width that falls short
    does not end the search (one noisy step would), a wider one may still clear the bar. Not
    below `floor`, nor above the widest probed.
    """
    widths = sorted(rates)
    chosen = widths[0]
    for w in widths[1:]:
        if pays(rates, chosen, w):
            chosen = w
    return max(chosen, min(floor, widths[-1]))


def pays(rates: dict[int, float], kept: int, wider: int) -> bool:
    """Whether `wider` rows add PROBE_GAIN per doubling of aggregate tokens/s over `kept` rows."""
    return rates[wider] >= rates[kept] * PROBE_GAIN ** math.log2(wider / kept)


def size_engine(*, width: int | None, context: int, memory_tokens: int | None, device: Device,
                kv_budget_tokens: int | None = None, probed: tuple[int, str] | None = None) -> Sizing:
    """The width (None: auto) and KV budget (None: from the rest) for a `context`-token window;
    `probed`: the width past which throughput stopped growing here, and what the probe saw."""
    cap = AUTO_WIDTH_CAP.get(device, UNKNOWN_MEMORY_WIDTH)
    if width is not None:
        chosen, how = width, f"batch {width} (configured)"
    elif memory_tokens is None:
        chosen, how = UNKNOWN_MEMORY_WIDTH, f"batch auto: {UNKNOWN_MEMORY_WIDTH} (the memory is not known)"
    else:
        fits = [w for w in range(1, cap + 1) if wanted_tokens(context, w) <= memory_tokens]
        chosen = max(fits, default=1)
        limit = f"the most on {device}" if chosen == cap else "as many as memory holds"
        if probed is not None and probed[0] < chosen:
            chosen, limit = probed[0], "wider stopped paying"
        how = f"batch auto: {chosen} ({limit}{'; ' + probed[1] if probed else ''})"
    auto = width is None
    if kv_budget_tokens is not None:
        return Sizing(chosen, kv_budget_tokens, memory_tokens, f"{how}; KV budget {kv_budget_tokens} tokens (configured)",
                      kv_configured=True, auto=auto)
    wanted = wanted_tokens(context, chosen)
    if memory_tokens is not None and wanted > memory_tokens:
        budget = max(1, memory_tokens)
        return Sizing(chosen, budget, memory_tokens, (
            f"{how}; KV budget {budget} tokens, all that memory holds: less than the {wanted} that "
            f"{'a whole ' + str(context) + '-token context' if wanted == context else f'{chosen} rows'} "
            "would want"), auto=auto)
    shape = f"the whole {context}-token context" if wanted == context else f"{chosen} rows of {ROW_TOKENS}"
    return Sizing(chosen, wanted, memory_tokens, f"{how}; KV budget {wanted} tokens ({shape})", auto=auto)


def short_memory_hint(sizing: Sizing) -> str:
    """What a refused request's message says to change."""
    if sizing.kv_configured:
        return "the KV budget was configured (--kv-budget-tokens): raise it"
    if sizing.is_clamped:
        return ("the memory left after the weights holds no more KV: a smaller `batch` or `max_context` in the "
                "model's [models.NAME] entry of mlxd's config, a smaller [pool] prompt_cache_bytes, or a smaller "
                "model leaves room for longer prompts")
    return ("a larger `max_context` in the model's [models.NAME] entry of mlxd's config raises it, up to the "
            "model's window")
