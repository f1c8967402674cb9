"""Whether a model fits this machine, and how fast it should decode: arithmetic on its files'
sizes, the memory budget and the machine's measured bandwidth (pure; the supervisor's
library.py gathers the inputs, engine/bandwidth.py measures the bandwidth).

- **Fits**: what the pool books to load it (its weights, the KV its engine's sizing books,
  the prompt cache's RAM tier; supervisor/engines/pool.py's `memory_estimate`, the same number
  that admits or refuses it) within the memory budget; the margin is what is left (negative:
  what is missing). `max_context` is the longest one sequence whose KV fits beside the weights
  and the prompt cache (at most the model's window).
- **Predicted decode speed** of a lone stream: a decode step reads every weight once (not an
  untied embedding table: it reads one row of it) and the KV of its context so far, and pays
  a cost per layer (kernel launches, the small operations between the matmuls), so a step
  takes bytes / bandwidth + layers x that cost, at TYPICAL_CONTEXT tokens of context. Both
  were measured on this machine by synthetic decodes (engine/bandwidth.py). Mixture-of-experts models are predicted as if every expert
  ran (slower than they are).
"""

from __future__ import annotations

import msgspec

TYPICAL_CONTEXT = 1024  # tokens of context a predicted step reads the KV of (a chat turn's)


class Fit(msgspec.Struct, kw_only=True):
    fits: bool
    weights_bytes: int  # on disk, as the pool counts them (a draft model's included)
    kv_bytes: int  # the KV its engine's sizing books
    reserved_bytes: int  # the prompt cache's RAM tier
    total_bytes: int  # what the pool books: weights + kv + reserved
    budget_bytes: int  # the pool's memory budget
    margin_bytes: int  # budget - total (negative: short by that much)
    context: int  # the model's window, capped by its max_context
    max_context: int  # the longest one sequence's KV that fits beside the rest (0: the weights alone do not)
    bytes_per_token: int  # what a decode step reads at TYPICAL_CONTEXT
    predicted_decode_tps: float | None  # 1 / (bytes_per_token / bandwidth + layers x a layer's cost); None: not measured
    measured_decode_tps: float | None = None  # mlxd's own, once the model has served (library.py)


def assess(*, weights_bytes: int, embedding_bytes: int, tied: bool, kv_per_token: int, window: int,
           booked_bytes: int, reserved_bytes: int, budget_bytes: int, bandwidth_bytes_s: float | None,
           tensor_bytes: int | None = None, layers: int = 0, layer_overhead_s: float = 0.0) -> Fit:
    """The fit of a model whose weights weigh `weights_bytes` on disk (`tensor_bytes` of them
    its tensors; its input embedding table `embedding_bytes`, also its output head when
    `tied`), whose KV costs `kv_per_token` bytes a
    token, with a `window`-token context, for which the pool books `booked_bytes` (weights, KV
    and `reserved_bytes` of prompt cache), in `budget_bytes` of memory."""
    room = budget_bytes - weights_bytes - reserved_bytes
    longest = min(window, room // kv_per_token) if kv_per_token > 0 and room > 0 else (window if room > 0 else 0)
    tensors = tensor_bytes if tensor_bytes else weights_bytes
    read = tensors - (0 if tied else embedding_bytes) + kv_per_token * min(TYPICAL_CONTEXT, window)
    step_s = read / bandwidth_bytes_s + layers * layer_overhead_s if bandwidth_bytes_s and read > 0 else 0.0
    predicted = round(1 / step_s, 1) if step_s > 0 else None
    return Fit(fits=booked_bytes <= budget_bytes, weights_bytes=weights_bytes,
               kv_bytes=max(0, booked_bytes - weights_bytes - reserved_bytes), reserved_bytes=reserved_bytes,
               total_bytes=booked_bytes, budget_bytes=budget_bytes, margin_bytes=budget_bytes - booked_bytes,
               context=window, max_context=max(0, longest), bytes_per_token=read, predicted_decode_tps=predicted)


PROBE_VERSION = 2  # engine/bandwidth.py's measurement; a kept one of another version is measured again


class Machine(msgspec.Struct, kw_only=True):
    device: str  # where engines run: metal, cuda or cpu
    memory_bytes: int  # the memory the models live in: physical RAM, or on CUDA the GPU's
    budget_bytes: int  # the pool's memory budget
    bandwidth_gbs: float | None  # measured (engine/bandwidth.py); None until it has been
    bandwidth_probe: str | None = None  # how it was measured
    bandwidth_measured_at: float | None = None  # unix time
    bandwidth_note: str | None = None  # why there is none (a probe that failed, or still runs)


class LibraryModel(msgspec.Struct, kw_only=True):
    id: str
    path: str
    source: str
    size_bytes: int
    quantization: str | None  # "4-bit", "8-bit", or the weights' dtype
    capabilities: list[str]
    state: str  # its engine's (stopped when it has none)
    fit: Fit | None  # None: its config lacks the sizes


class Library(msgspec.Struct, kw_only=True):
    """GET /library: every model on disk and whether it fits this machine."""

    machine: Machine
    models: list[LibraryModel]
