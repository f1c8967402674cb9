// A model's load progress (the `load` field of /v1/models and /admin/engines): a bar when the
// total is known, else a spinner with the time so far.
import { el } from "./page.js";
import { formatBytes, formatSeconds } from "./units.js";

// The names of mlxd/protocol/stats.py's PHASE_NAMES, as `mlxd load` and the stream's waiting comments say them.
const PHASES = {
  spawn: "Starting the engine", weights: "Reading weights", tokenizer: "Loading the tokenizer",
  warmup: "Warming up GPU kernels",
};

/** A one-line description of `load`, e.g. "Reading weights: 1.2 GiB of 4.0 GiB (30%), 3.1 s". */
export function describeLoad(load) {
  const phase = PHASES[load.phase] || `Loading (${load.phase})`;
  const time = formatSeconds(load.elapsed_s || 0);
  if (!load.total) return `${phase}, ${time}`;
  const pct = Math.round((100 * load.done) / load.total);
  const amount = load.unit === "bytes" ? `${formatBytes(load.done)} of ${formatBytes(load.total)}` : `${load.done} of ${load.total}`;
  return `${phase}: ${amount} (${pct}%), ${time}`;
}

/** A node showing `load` (progress bar or spinner, and its description). */
export function makeLoadView(load, state) {
  const box = el("div", "load");
  if (!load) {
    const text = state === "ready" ? "Waiting for the first token…" : state === "starting" ? "Starting…" : "Waiting for the model…";
    box.append(el("span", "spinner"), el("span", "load-text", text));
    return box;
  }
  if (load.total) {
    const bar = el("progress");
    bar.max = load.total;
    bar.value = Math.min(load.done, load.total);
    bar.setAttribute("aria-label", PHASES[load.phase] || "Loading");
    box.append(bar);
  } else {
    box.append(el("span", "spinner"));
  }
  box.append(el("span", "load-text", describeLoad(load)));
  return box;
}
