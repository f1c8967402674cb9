// The dashboard: the pool's models and engines, live charts, and load/pin/unload/drain.
import { ApiError, apiJson } from "./api.js";
import { drawChart } from "./chart.js";
import { announce, confirmAction, el, markReady } from "./page.js";
import { makePoller } from "./poller.js";
import { makeLoadView } from "./progress.js";
import { formatBytes, formatRate, formatSeconds } from "./units.js";

const POLL_MS = 2000;
const CHART_SPAN_S = 300;  // of the timeline's 10 minutes, the last 5: recent traffic stays readable
const FACTS = [["memory", "Memory"], ["disk", "On disk"], ["fits", "Fits this machine"], ["speed", "Decode tok/s"],
  ["work", "In flight / queued"], ["ttl", "Idle unload"], ["lease", "Lease"], ["restarts", "Restarts"],
  ["uptime", "Up for"]];
const LIBRARY_MS = 15000;  // /library (the fit check) is read this often at most
let library = { at: 0, rows: new Map() };
const cards = new Map();  // model id -> card
const poller = makePoller(refresh, POLL_MS);  // a hidden tab polls nothing
const pollSoon = poller.soon;

export function startDashboard() {
  poller.start();
}

export function stopDashboard() {
  poller.stop();
}

async function fetchTimeline() {
  try {
    return await apiJson("/admin/timeline", { quiet: true });
  } catch (e) {
    if (e instanceof ApiError && e.status === 404) return null;  // an mlxd without charts
    throw e;
  }
}

async function refresh() {
  const [engines, models, timeline] = await Promise.allSettled([
    apiJson("/admin/engines", { quiet: true }), apiJson("/v1/models", { quiet: true }), fetchTimeline()]);
  const failed = [engines, models].find((r) => r.status === "rejected");
  const error = document.getElementById("dash-error");
  error.hidden = !failed;
  error.textContent = failed ? `Could not read the pool: ${failed.reason.message}` : "";
  if (engines.status === "fulfilled") renderPool(engines.value);
  await refreshLibrary();
  if (engines.status === "fulfilled" || models.status === "fulfilled") {
    renderCards(mergeRows(engines.value?.data ?? [], models.value?.data ?? []));
  }
  renderCharts(timeline.status === "fulfilled" ? timeline.value : null);
  markReady();
}

/** The fit check of every model (GET /library), read again after LIBRARY_MS; it never waits
 * for the bandwidth probe (the first read starts it; a later one has its figures). */
async function refreshLibrary() {
  if (Date.now() - library.at < LIBRARY_MS) return;
  try {
    const answer = await apiJson("/library?wait_s=0", { quiet: true });
    const measured = Boolean(answer.machine?.bandwidth_gbs);
    library = { at: measured ? Date.now() : Date.now() - LIBRARY_MS + 2000,
                rows: new Map(answer.models.map((m) => [m.id, m.fit])) };
  } catch {
    library.at = Date.now();  // an mlxd without /library: the cards say "–"
  }
}

/** One row per model: what /v1/models says, overlaid with its engine's row when it has one,
 * and its fit check. */
function mergeRows(engineRows, models) {
  const rows = new Map(models.map((m) => [m.id, { model: m.id, ...m }]));
  for (const e of engineRows) rows.set(e.model, { ...(rows.get(e.model) || {}), ...e });
  for (const [id, row] of rows) row.fit = library.rows.get(id) ?? null;
  return [...rows.values()];
}

/** "yes, 12 GB spare" / "no, short 3 GB" / "–". */
function fitText(fit) {
  if (!fit) return "–";
  const margin = formatBytes(Math.abs(fit.margin_bytes));
  return fit.fits ? `yes, ${margin} spare` : `no, short ${margin}`;
}

/** "predicted 41 · measured 38" (either may be missing). */
function speedText(fit) {
  const parts = [];
  if (fit?.predicted_decode_tps) parts.push(`predicted ${Math.round(fit.predicted_decode_tps)}`);
  if (fit?.measured_decode_tps) parts.push(`measured ${Math.round(fit.measured_decode_tps)}`);
  return parts.join(" · ") || "–";
}

function renderPool(pool) {
  const meter = document.getElementById("budget-meter");
  const budget = pool.budget_bytes;
  meter.value = budget ? Math.min(1, pool.used_bytes / budget) : 0;
  document.getElementById("budget-text").textContent = budget
    ? `${formatBytes(pool.used_bytes)} of ${formatBytes(budget)} budget`
    : `${formatBytes(pool.used_bytes)} (no budget)`;
  const spare = pool.spare?.pid ? (pool.spare.warm ? "warm" : "starting") : "none";
  const facts = [`Swaps: ${pool.evictions ?? 0}`, `Max loaded: ${pool.max_loaded ?? "–"}`, `Spare engine: ${spare}`];
  if (pool.machine_leased) facts.push("Machine leased");
  document.getElementById("pool-facts").textContent = facts.join(" · ");
}

function renderCards(rows) {
  const list = document.getElementById("model-cards");
  document.getElementById("no-models").hidden = rows.length > 0;
  for (const row of rows) {
    let card = cards.get(row.model);
    if (!card) {
      card = makeCard(row.model);
      cards.set(row.model, card);
      list.append(card.node);
    }
    updateCard(card, row);
  }
}

function makeCard(id) {
  const node = el("li", "card");
  node.dataset.model = id;
  const titleId = `model-${cards.size}`;
  const title = el("h3", "", id);
  title.id = titleId;
  const card = { node, row: { model: id }, badge: el("span", "badge"), pin: el("span", "tag", "pinned"),
    load: el("div", "load-slot"), failure: el("p", "error"), facts: {}, buttons: {} };
  const head = el("div", "card-head");
  head.append(title, card.badge, card.pin);
  const facts = el("dl", "facts");
  for (const [key, label] of FACTS) {
    const pair = el("div");
    card.facts[key] = el("dd");
    pair.append(el("dt", "", label), card.facts[key]);
    facts.append(pair);
  }
  const actions = el("div", "actions");
  for (const [act, label] of [["load", "Load"], ["pin", "Pin"], ["unload", "Unload"], ["drain", "Drain"]]) {
    const button = el("button", act === "unload" ? "danger" : "", label);
    button.type = "button";
    button.dataset.act = act;
    button.setAttribute("aria-describedby", titleId);
    button.addEventListener("click", () => runAction(act, card.row));
    card.buttons[act] = button;
    actions.append(button);
  }
  node.append(head, card.load, card.failure, facts, actions);
  return card;
}

function updateCard(card, row) {
  card.row = row;
  const state = row.state || "stopped";
  card.node.dataset.state = state;
  card.badge.textContent = state;
  card.badge.className = `badge state-${state}`;
  card.pin.hidden = !row.pinned;
  card.failure.hidden = !row.failure;
  card.failure.textContent = row.failure ? `Failed: ${row.failure}` : "";
  card.load.replaceChildren(...(state === "starting" ? [makeLoadView(row.load ?? null, state)] : []));
  const f = card.facts;
  f.memory.textContent = row.rss_bytes || row.memory_estimate_bytes
    ? `${formatBytes(row.rss_bytes)} (estimate ${formatBytes(row.memory_estimate_bytes)})` : "–";
  f.disk.textContent = formatBytes(row.size_bytes);
  f.fits.textContent = fitText(row.fit);
  f.speed.textContent = speedText(row.fit);
  f.work.textContent = `${row.in_flight ?? 0} / ${row.queued ?? 0}`;
  f.ttl.textContent = !row.idle_ttl_s ? "never"
    : row.expires_in_s != null ? `in ${formatSeconds(row.expires_in_s)} (after ${formatSeconds(row.idle_ttl_s)} idle)`
      : `after ${formatSeconds(row.idle_ttl_s)} idle`;
  f.lease.textContent = row.lease ? `${row.lease.holder || row.lease.id}` : "none";
  f.restarts.textContent = String(row.restarts ?? 0);
  f.uptime.textContent = formatSeconds(row.uptime_s);
  const b = card.buttons;
  b.load.disabled = !["stopped", "failed"].includes(state);
  b.pin.textContent = row.pinned ? "Unpin" : "Pin";
  b.pin.disabled = ["draining", "stopping"].includes(state);
  b.unload.disabled = !["ready", "starting"].includes(state);
  b.drain.disabled = state !== "ready";
}

const ACTIONS = {
  load: (r) => ["/admin/load", { model: r.model }, "Loading"],
  pin: (r) => ["/admin/load", { model: r.model, pin: !r.pinned }, r.pinned ? "Unpinning" : "Pinning"],
  unload: (r) => ["/admin/unload", { model: r.model, force: Boolean(r.pinned) }, "Unloading"],
  drain: (r) => ["/admin/drain", { model: r.model }, "Draining"],
};

function doneMessage(act, id, res) {
  if (act === "load") return `${id} is ${res.state} (load took ${formatRate(res.load_ms / 1000)} s).`;
  if (act === "pin") return res.pinned ? `${id} is loaded and pinned.` : `${id} is no longer pinned.`;
  if (act === "unload") return res.was_loaded ? `${id} is unloaded.` : `${id} was not loaded.`;
  return `${id} is drained.`;
}

async function runAction(act, row) {
  const id = row.model;
  if (act === "unload") {
    const question = row.pinned
      ? `Unload ${id}? It is pinned: unloading also unpins it.`
      : `Unload ${id}? Requests in flight finish first; queued ones wait for it to load again.`;
    if (!await confirmAction(question, "Unload")) return;
  }
  const [path, body, doing] = ACTIONS[act](row);
  announce(`${doing} ${id}…`, "busy");
  pollSoon(300);  // show "starting" and the load progress while the call runs
  try {
    const res = await apiJson(path, { method: "POST", body });
    announce(doneMessage(act, id, res));
  } catch (e) {
    announce(`${doing} ${id} failed: ${e.message}`, "error");
  }
  pollSoon(0);
}

function renderCharts(timeline) {
  const models = Object.entries(timeline?.models ?? {});
  document.getElementById("chart-note").hidden = models.length > 0;
  const step = timeline?.step_s || 2;
  const keep = Math.round(CHART_SPAN_S / step);
  const span = `-${Math.round(CHART_SPAN_S / 60)} min`;
  const tps = models.map(([name, m], index) => ({ name, index, values: m.completion_tokens.slice(-keep).map((c) => c / step) }));
  const ttft = models.map(([name, m], index) => ({ name, index, values: m.ttft_ms.slice(-keep) }));
  const lastTps = tps.reduce((sum, s) => sum + (s.values.at(-1) ?? 0), 0);
  const lastTtft = ttft.map((s) => s.values.findLast((v) => v !== null)).filter((v) => v !== undefined);
  document.getElementById("tps-now").textContent = models.length ? `now ${formatRate(lastTps)}` : "";
  document.getElementById("ttft-now").textContent = lastTtft.length ? `latest ${Math.round(Math.max(...lastTtft))}` : "";
  drawChart(document.getElementById("chart-tps"), tps,
    { spanLabel: span, format: formatRate, label: `Tokens per second, last ${span.slice(1)}: now ${formatRate(lastTps)}` });
  drawChart(document.getElementById("chart-ttft"), ttft,
    { spanLabel: span, format: (v) => `${Math.round(v)} ms`, label: "Median time to first token per 2 s" });
  const legend = document.getElementById("chart-legend");
  legend.replaceChildren(...models.map(([name], index) => {
    const item = el("li", "", name);
    item.prepend(el("span", `swatch series-${index % 6}`));
    return item;
  }));
}
