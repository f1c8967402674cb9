"""Tables and short texts for the admin commands (pure: no I/O)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mlxd.protocol.units import format_size

LEASE_COLUMN_CHARS = 28


def format_ms(ms: float | None) -> str:
    """850 ms, 1.3 s, 2 min 5 s."""
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms:.0f} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    minutes, seconds = divmod(round(ms / 1000), 60)
    return f"{minutes} min {seconds} s"


_SPANS = ((86400, "day"), (3600, "hour"), (60, "minute"), (1, "second"))


def human_span(seconds: float) -> str:
    """The largest whole unit: `45 seconds`, `1 minute`, `3 hours`, `2 days`."""
    seconds = abs(seconds)
    for size, name in _SPANS:
        if seconds >= size:
            count = int(seconds // size)
            return f"{count} {name}{'' if count == 1 else 's'}"
    return "less than a second"


def relative_time(delta_s: float) -> str:
    """`4 minutes from now` for a positive delta, `3 minutes ago` for a negative one."""
    if abs(delta_s) < 1:
        return "now"
    return f"{human_span(delta_s)} {'from now' if delta_s > 0 else 'ago'}"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns, three spaces apart, no trailing blanks."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def shorten(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, with `…` when cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def models_text(listing: Mapping[str, Any]) -> str:
    """`mlxd models`: every model the daemon can serve."""
    rows = [(m["id"], format_size(m.get("size_bytes")), context_text(m.get("context_window")),
             ",".join(c for c in m.get("capabilities", []) if c != "completion") or "-", m.get("source", "-"),
             m.get("state", "-"))
            for m in listing.get("data", [])]
    if not rows:
        return "no models found (see `[models.NAME]` in the config, or `mlxd import-default`)"
    return render_table(("NAME", "SIZE", "CONTEXT", "TAKES", "SOURCE", "STATE"), rows)


def library_text(library: Mapping[str, Any]) -> str:
    """`mlxd models --fit`: every model, whether it fits, and its decode speed."""
    m = library.get("machine", {})
    gbs = m.get("bandwidth_gbs")
    head = (f"{m.get('device', '?')}: memory budget {format_size(m.get('budget_bytes'))} of "
            f"{format_size(m.get('memory_bytes'))}; decode bandwidth "
            + (f"{gbs:.1f} GB/s (measured)" if gbs else f"not measured ({m.get('bandwidth_note') or 'unknown'})"))
    rows = []
    for model in library.get("models", []):
        f = model.get("fit") or {}
        fits = "-" if not f else ("yes" if f.get("fits") else "no")
        margin = format_size(abs(f["margin_bytes"])) if f else "-"
        if f:
            margin = margin if f["margin_bytes"] >= 0 else f"short {margin}"
        predicted, measured = f.get("predicted_decode_tps"), f.get("measured_decode_tps")
        rows.append((model["id"], format_size(model.get("size_bytes")), model.get("quantization") or "-", fits, margin,
                     context_text(f.get("max_context")) if f else "-",
                     f"{predicted:.0f}" if predicted else "-", f"{measured:.0f}" if measured else "-"))
    if not rows:
        return head + "\nno models found (see `[models.NAME]` in the config, or `mlxd import-default`)"
    return head + "\n" + render_table(("NAME", "SIZE", "WEIGHTS", "FITS", "MARGIN", "MAX CTX", "TOK/S PREDICTED",
                                       "TOK/S MEASURED"), rows)


def context_text(tokens: int | None) -> str:
    """A context window in tokens: 8K, 128K, 1M."""
    if not tokens:
        return "-"
    if tokens >= 1 << 20 and tokens % (1 << 20) == 0:
        return f"{tokens >> 20}M"
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def running_engines(listing: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The engines `mlxd ps` shows: every one not stopped."""
    return [e for e in listing.get("data", []) if e.get("state") != "stopped"]


def until_text(engine: Mapping[str, Any]) -> str:
    """When the idle engine unloads: `pinned`, `forever` (idle TTL -1), `4 minutes from now`, or `-`."""
    if engine.get("pinned"):
        return "pinned"
    if (expires_in := engine.get("expires_in_s")) is not None:
        return relative_time(max(expires_in, 0.0))
    # No expiry: a model that never idles out, or one whose clock is not running (busy, starting).
    return "forever" if (engine.get("idle_ttl_s") or 0) < 0 else "-"


def lease_text(engine: Mapping[str, Any]) -> str:
    """Who holds the engine's lease, or `-`."""
    lease = engine.get("lease")
    return shorten(str(lease.get("holder") or lease.get("id")), LEASE_COLUMN_CHARS) if lease else "-"


def budget_line(listing: Mapping[str, Any]) -> str:
    """`memory: 1.2 GB of 12 GB budget in use`, and the cap on loaded models if any."""
    used, budget = listing.get("used_bytes"), listing.get("budget_bytes")
    line = f"memory: {format_size(used)} of {format_size(budget)} budget in use" if budget else \
        f"memory: {format_size(used)} in use (no budget)"
    if (max_loaded := listing.get("max_loaded")) is not None:
        line += f", at most {max_loaded} model{'' if max_loaded == 1 else 's'} loaded"
    return line + ("; the machine is leased (mlxd lease --all)" if listing.get("machine_leased") else "")


def ps_text(listing: Mapping[str, Any]) -> str:
    """`mlxd ps`: the live engines, why failed ones failed, and the memory budget."""
    engines = running_engines(listing)
    rows = [
        (e["model"], state_text(e), format_size(e.get("memory_estimate_bytes")),
         format_size(e.get("rss_bytes")), e.get("pid") or "-", batch_text(e), e.get("in_flight", 0),
         e.get("queued", 0), cache_text(e.get("prompt_cache")), until_text(e), lease_text(e))
        for e in engines
    ]
    headers = ("NAME", "STATE", "SIZE", "RSS", "PID", "BATCH", "IN FLIGHT", "QUEUED", "PROMPT CACHE", "UNTIL",
               "LEASE")
    lines = [render_table(headers, rows)] if rows else ["no models loaded"]
    lines += [failure_line(e) for e in engines if e.get("failure")]
    return "\n".join([*lines, budget_line(listing)])


def batch_text(engine: Mapping[str, Any]) -> str:
    """`32 (auto)`: the rows it decodes at once, and whether `auto` chose them; `auto` until it serves."""
    asked, width = engine.get("batch"), engine.get("width")
    if width is None:
        return str(asked) if asked is not None else "-"
    return f"{width} (auto)" if asked == "auto" else str(width)


def state_text(engine: Mapping[str, Any]) -> str:
    """`ready`, or `starting (reading weights 45%)` while it loads."""
    state = str(engine.get("state", "-"))
    load = engine.get("load")
    if isinstance(load, Mapping):
        from mlxd.cli.admin.load_progress import phase_text

        return f"{state} ({phase_text(load)})"
    return state


def cache_text(cache: Mapping[str, Any] | None) -> str:
    """`48 MB + 1.2 GB SSD, 75% hit`: what the engine's prompt cache holds, and how often it served."""
    if not cache:
        return "-"
    ram, ssd = cache.get("ram") or {}, cache.get("ssd")
    text = format_size(ram.get("bytes"))
    if isinstance(ssd, Mapping):
        text += f" + {format_size(ssd.get('bytes'))} SSD"
    hits = sum((cache.get("hits") or {}).values())
    if looked := hits + int(cache.get("misses") or 0):
        text += f", {round(100 * hits / looked)}% hit"
    return text


def failure_line(engine: Mapping[str, Any]) -> str:
    """`qwen failed: <reason>; retried in 12 s (mlxd load qwen retries now)`."""
    line = f"{engine['model']} failed: {engine['failure']}"
    retry = engine.get("retry_in_s")
    if isinstance(retry, int | float):
        line += f"; retried in {math.ceil(retry)} s (`mlxd load {engine['model']}` retries now)"
    return line


def load_text(result: Mapping[str, Any]) -> str:
    """`mlxd load`: the model is ready."""
    pinned = ", pinned" if result.get("pinned") else ""
    return f"{result['model']} is ready (loaded in {format_ms(result.get('load_ms'))}{pinned})"


def unload_text(result: Mapping[str, Any]) -> str:
    """`mlxd unload`: unloaded, with what its drain finished and cancelled."""
    if not result.get("was_loaded"):
        return f"{result['model']} was not loaded"
    drain = result.get("drain") or {}
    counts = [f"{drain[k]} {k}" for k in ("finished", "cancelled") if drain.get(k)]
    return f"{result['model']} unloaded" + (f" ({', '.join(counts)})" if counts else "")


def drain_text(result: Mapping[str, Any]) -> str:
    """`mlxd drain`: per model, requests finished and cancelled, time waited, cache written."""
    rows = [(d["model"], d.get("finished", 0), d.get("cancelled", 0), format_ms(d.get("waited_ms")),
             format_size(d.get("cache_written_bytes"))) for d in result.get("drained", [])]
    if not rows:
        return "nothing to drain (no models loaded)"
    return render_table(("NAME", "FINISHED", "CANCELLED", "WAITED", "CACHE WRITTEN"), rows)
