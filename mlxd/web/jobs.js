// The lab's jobs: the list (polled, newest first), and one job's detail: its live updates (the
// job's SSE stream), its loss chart and its worker's log.
import { api, apiJson } from "./api.js";
import { drawChart } from "./chart.js";
import { announce, confirmAction, el, markReady } from "./page.js";
import { sseData } from "./stream.js";
import { makePoller } from "./poller.js";
import { formatRate, formatSeconds } from "./units.js";

const POLL_MS = 2000;
const LOG_POLL_MS = 2000;
const RETRY_MS = 2000;
const ANSI = /\x1b\[[0-9;?]*[A-Za-z]/g;  // mlx-lm's terminal colours, in the worker's log
const FINISHED = new Set(["succeeded", "failed", "cancelled"]);
const KINDS = { finetune: "Fine-tune", quantize: "Quantize", fuse: "Fuse", merge: "Merge", dataset: "Dataset", push: "Push" };
const cards = new Map();  // job id -> card
const states = new Map();  // job id -> its last state seen, to tell when one finishes
let onFinished = () => {};
let selected = null;  // the job shown in detail: {id, job, controller, logTimer}
let submitted = 0;  // jobs submitted from this page: a list read before the last one is stale
const $ = (id) => document.getElementById(id);
const poller = makePoller(refresh, POLL_MS);  // a hidden tab polls nothing
const pollSoon = poller.soon;

/** Start polling the job list (and following the selected job); `finished(job)` is called when
 * a job is seen to end, so that the forms can list what it made. */
export function startJobs(finished) {
  onFinished = finished;
  wire();
  poller.start();  // at once, also when already polling: a key was just entered
  if (selected) follow(selected.id);
}

export function stopJobs() {
  poller.stop();
  stopFollowing();
}

/** Show `job` (just submitted) in the list and in detail. */
export function showJob(job) {
  submitted++;
  renderList([job, ...[...cards.values()].map((c) => c.job).filter((j) => j.id !== job.id)]);
  follow(job.id, job);
  pollSoon(0);
}

let wired = false;
function wire() {
  if (wired) return;
  wired = true;
  $("job-detail-close").addEventListener("click", () => {
    const id = selected?.id;
    stopFollowing();
    selected = null;
    $("job-detail").hidden = true;
    markSelected();
    cards.get(id)?.buttons.show.focus();
  });
}

async function refresh() {
  const error = $("lab-error");
  try {
    const before = submitted;
    const { data } = await apiJson("/lab/jobs?limit=50", { quiet: true });
    error.hidden = true;
    if (poller.active && before === submitted) renderList(data);
  } catch (e) {
    error.hidden = false;
    error.textContent = `Could not read the jobs: ${e.message}`;
  }
  markReady();
}

/** What a job works on, in a few words: "zebra, from SmolLM2" or "a + b → both". */
export function jobSubject(job) {
  const r = job.request || {};
  if (job.kind === "merge") return `${(r.adapters || []).join(" + ")} → ${r.name}`;
  if (job.kind === "fuse") return `${r.adapter} into ${r.model}${r.name ? ` → ${r.name}` : ""}`;
  if (job.kind === "push") return `${r.kind} ${r.name} → ${r.repo_id}`;
  if (job.kind === "quantize") {
    const learned = ["gptq", "awq", "dwq"].includes(r.method) ? ` ${r.method.toUpperCase()}` : "";
    const how = r.recipe || (r.target_bpw ? `${r.target_bpw} bits/weight` : `${r.bits ?? 4}-bit${learned}`);
    return `${r.model}, ${how}${r.name ? ` → ${r.name}` : ""}`;
  }
  if (job.kind === "dataset") return `${r.name}, ${r.template} by ${r.model}`;
  return r.name ? `${r.name}, from ${r.model}` : String(r.model ?? "");
}

function jobTitle(job) {
  return `${KINDS[job.kind] || job.kind}: ${jobSubject(job)}`;
}

function renderList(jobs) {
  const list = $("job-list");
  $("no-jobs").hidden = jobs.length > 0;
  const seen = new Set();
  jobs.forEach((job, index) => {
    seen.add(job.id);
    const card = cards.get(job.id) || makeCard(job);
    cards.set(job.id, card);
    // Only a node out of place moves: a moved node would lose the keyboard's focus.
    if (list.children[index] !== card.node) list.insertBefore(card.node, list.children[index] ?? null);
    update(job);
  });
  for (const [id, card] of cards) {
    if (!seen.has(id)) {
      card.node.remove();
      cards.delete(id);
    }
  }
  markSelected();
}

function makeCard(job) {
  const node = el("li", "job");
  node.dataset.job = job.id;
  const title = el("h3");
  title.id = `job-${job.id}`;
  const card = { node, job, title, badge: el("span", "badge"), about: el("p", "muted"), progress: el("div"),
    line: el("p", "job-line"), error: el("p", "error"), result: el("p", "result"), buttons: {} };
  const head = el("div", "card-head");
  head.append(title, card.badge);
  const actions = el("div", "actions");
  for (const [act, label, cls] of [["show", "Details", "quiet"], ["cancel", "Cancel", "danger"]]) {
    const button = el("button", cls, label);
    button.type = "button";
    button.dataset.act = act;
    button.setAttribute("aria-describedby", title.id);
    card.buttons[act] = button;
    actions.append(button);
  }
  card.buttons.show.setAttribute("aria-controls", "job-detail");
  card.buttons.show.addEventListener("click", () => {
    follow(card.job.id, card.job);
    $("job-detail-title").focus();
  });
  card.buttons.cancel.addEventListener("click", () => cancel(card.job));
  node.append(head, card.about, card.progress, card.line, card.error, card.result, actions);
  return card;
}

/** A job's new state, wherever it is shown: its card, and the detail when it is selected. */
function update(job) {
  // A poll answered before the stream's last event must not bring an ended job back.
  if (FINISHED.has(states.get(job.id)) && !FINISHED.has(job.state)) return;
  const card = cards.get(job.id);
  if (card) updateCard(card, job);
  if (selected?.id === job.id) renderDetail(job);
  const before = states.get(job.id);
  states.set(job.id, job.state);
  if (before && !FINISHED.has(before) && FINISHED.has(job.state)) {
    announce(`${jobTitle(job)}: ${job.state}.`, job.state === "succeeded" ? "ok" : "error");
    onFinished(job);
  }
}

function updateCard(card, job) {
  card.job = job;
  card.node.dataset.state = job.state;
  card.title.textContent = jobTitle(job);
  card.badge.textContent = job.state;
  card.badge.className = `badge state-${job.state}`;
  card.about.textContent = timeLine(job);
  card.progress.replaceChildren(...progressView(job));
  card.line.textContent = progressLine(job);
  card.line.hidden = !card.line.textContent;
  card.error.hidden = !job.error;
  card.error.textContent = job.error ? `Failed: ${job.error}` : "";
  card.result.hidden = !job.result;
  card.result.textContent = job.result ? `Made ${job.result.kind} ${job.result.name}` : "";
  card.buttons.cancel.hidden = FINISHED.has(job.state);
}

function timeLine(job) {
  const parts = [`Submitted ${when(job.created_at)}`];
  if (job.started_at) {
    const ran = (job.ended_at ?? Date.now() / 1000) - job.started_at;
    parts.push(`${job.ended_at ? "ran" : "running for"} ${formatSeconds(Math.max(0, ran))}`);
  }
  return parts.join(" · ");
}

function when(epochS) {
  const date = new Date(epochS * 1000);
  return date.toDateString() === new Date().toDateString() ? date.toLocaleTimeString() : date.toLocaleString();
}

/** A bar for step/total while a job runs with a known total, else a spinner while it runs. */
function progressView(job) {
  const p = job.progress;
  if (job.state !== "running") return [];
  const box = el("div", "load");
  if (p?.total) {
    const bar = el("progress");
    bar.max = p.total;
    bar.value = Math.min(p.step ?? 0, p.total);
    bar.setAttribute("aria-label", `${KINDS[job.kind] || job.kind} progress`);
    box.append(bar);
  } else {
    box.append(el("span", "spinner"));
  }
  box.append(el("span", "load-text", stageText(job)));
  return [box];
}

function stageText(job) {
  const p = job.progress;
  if (!p) return "Starting…";
  const stage = p.stage ? p.stage[0].toUpperCase() + p.stage.slice(1) : "Working";
  const steps = p.total ? `: step ${p.step ?? 0} of ${p.total} (${Math.round((100 * (p.step ?? 0)) / p.total)}%)` : "";
  return `${stage}${steps}${p.message ? ` · ${p.message}` : ""}`;
}

/** "loss 1.234 · val 1.456 · 512 tokens/s · ETA 2 min", from what the job reports. */
function progressLine(job) {
  const p = job.progress;
  if (!p || job.state === "queued") return "";
  const parts = [];
  if (p.loss != null) parts.push(`loss ${p.loss.toFixed(3)}`);
  if (p.val_loss != null) parts.push(`validation loss ${p.val_loss.toFixed(3)}`);
  if (p.tokens_per_s != null) parts.push(`${formatRate(p.tokens_per_s)} tokens/s`);
  if (p.eta_s != null && job.state === "running") parts.push(`ETA ${formatSeconds(p.eta_s)}`);
  return parts.join(" · ");
}

async function cancel(job) {
  const question = job.state === "running"
    ? `Cancel ${jobTitle(job)}? Its worker is stopped; what it made so far is discarded.`
    : `Cancel ${jobTitle(job)}? It will never start.`;
  if (!await confirmAction(question, "Cancel job")) return;
  try {
    update(await apiJson(`/lab/jobs/${encodeURIComponent(job.id)}/cancel`, { method: "POST" }));
    announce(`Cancelled ${jobTitle(job)}.`);
  } catch (e) {
    announce(`Could not cancel the job: ${e.message}`, "error");
  }
  pollSoon(0);
}

function markSelected() {
  for (const [id, card] of cards) {
    if (id === selected?.id) card.node.setAttribute("aria-current", "true");
    else card.node.removeAttribute("aria-current");
  }
}

/** Show job `id` in detail, following its stream and its log until it ends. */
function follow(id, job = null) {
  if (selected?.id !== id) {
    stopFollowing();
    selected = { id, job, controller: null, logTimer: 0 };
    $("job-log").textContent = "";
  }
  markSelected();
  $("job-detail").hidden = false;
  if (job) renderDetail(job);
  if (!poller.active || selected.controller) return;
  const sel = selected;
  sel.controller = new AbortController();
  stream(sel);
  refreshLog(sel);
}

function stopFollowing() {
  if (!selected) return;
  selected.controller?.abort();
  selected.controller = null;
  clearTimeout(selected.logTimer);
}

async function stream(sel) {
  const { signal } = sel.controller;
  const path = `/lab/jobs/${encodeURIComponent(sel.id)}/stream`;
  while (!signal.aborted && !FINISHED.has(sel.job?.state)) {
    try {
      const resp = await api(path, { signal, quiet: true });
      for await (const job of sseData(resp.body)) update(job);
    } catch (e) {
      if (signal.aborted) return;
      $("job-detail-error").hidden = false;
      $("job-detail-error").textContent = `Lost the job's updates (${e.message}); trying again…`;
    }
    if (!FINISHED.has(sel.job?.state)) await new Promise((resolve) => setTimeout(resolve, RETRY_MS));
  }
}

function renderDetail(job) {
  const sel = selected;
  const wasRunning = sel.job && !FINISHED.has(sel.job.state);
  sel.job = job;
  $("job-detail-title").textContent = jobTitle(job);
  $("job-detail-title").tabIndex = -1;
  $("job-detail-state").textContent = job.state;
  $("job-detail-state").className = `badge state-${job.state}`;
  $("job-detail-progress").replaceChildren(...progressView(job));
  $("job-detail-error").hidden = !job.error;
  $("job-detail-error").textContent = job.error ? `Failed: ${job.error}` : "";
  $("job-detail-result").hidden = !job.result;
  $("job-detail-result").textContent = job.result ? `Made ${job.result.kind} ${job.result.name} at ${job.result.path}` : "";
  $("job-detail-facts").replaceChildren(...detailFacts(job).map(([label, value]) => {
    const pair = el("div");
    pair.append(el("dt", "", label), el("dd", "", value));
    return pair;
  }));
  drawLosses(job);
  if (wasRunning && FINISHED.has(job.state)) refreshLog(sel);  // its last lines
}

/** "Learning rate" for `learning_rate`. */
function labelOf(key) {
  const words = key.replaceAll("_", " ");
  return words[0].toUpperCase() + words.slice(1);
}

/** A request's or a result's value as text: floats to 4 significant digits, lists joined. */
function valueText(value) {
  if (Array.isArray(value)) return value.map(valueText).join(", ");
  if (typeof value === "number" && !Number.isInteger(value)) return String(Number(value.toPrecision(4)));
  return String(value);
}

function detailFacts(job) {
  const p = job.progress || {};
  const facts = [["Job", job.id], ["Times", timeLine(job)]];
  const plain = ([, value]) => value !== null && value !== undefined && (typeof value !== "object" || Array.isArray(value));
  for (const [key, value] of Object.entries(job.request || {}).filter(plain)) facts.push([labelOf(key), valueText(value)]);
  if (p.loss != null) facts.push(["Loss", p.loss.toFixed(4)]);
  if (p.val_loss != null) facts.push(["Validation loss", p.val_loss.toFixed(4)]);
  if (p.tokens_per_s != null) facts.push(["Tokens/s", formatRate(p.tokens_per_s)]);
  if (p.trained_tokens != null) facts.push(["Trained tokens", String(p.trained_tokens)]);
  if (p.eta_s != null && job.state === "running") facts.push(["ETA", formatSeconds(p.eta_s)]);
  for (const [key, value] of Object.entries(job.result?.details || {}).filter(plain)) facts.push([labelOf(key), valueText(value)]);
  return facts;
}

function drawLosses(job) {
  const losses = job.losses || [];
  $("loss-figure").hidden = losses.length === 0;
  if (!losses.length) return;
  const [lastStep, lastLoss] = losses.at(-1);
  $("loss-now").textContent = `latest ${lastLoss.toFixed(3)} at step ${lastStep}`;
  drawChart($("chart-loss"), [{ name: "loss", index: 0, values: losses.map(([, loss]) => loss) }], {
    spanLabel: `step ${losses[0][0]}`, endLabel: `step ${lastStep}`, format: (v) => v.toFixed(v < 10 ? 1 : 0),
    label: `Training loss over ${losses.length} reports, from ${losses[0][1].toFixed(3)} at step ${losses[0][0]} `
      + `to ${lastLoss.toFixed(3)} at step ${lastStep}`,
  });
}

/** The job's log, again every few seconds while it runs; a reader at its end stays there. */
async function refreshLog(sel) {
  clearTimeout(sel.logTimer);
  try {
    const resp = await api(`/lab/jobs/${encodeURIComponent(sel.id)}/log`, { quiet: true, signal: sel.controller?.signal });
    const text = (await resp.text()).replace(ANSI, "");
    const log = $("job-log");
    if (selected !== sel) return;
    const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 24;
    const shown = text || "(nothing logged yet)";
    if (log.textContent !== shown) {
      log.textContent = shown;
      if (atEnd) log.scrollTop = log.scrollHeight;
    }
  } catch (e) {
    if (e.name === "AbortError") return;
    if (selected === sel) $("job-log").textContent = `Could not read the log: ${e.message}`;
  }
  if (selected === sel && sel.controller && !FINISHED.has(sel.job?.state)) {
    sel.logTimer = setTimeout(() => refreshLog(sel), LOG_POLL_MS);
  }
}
