// The curve designer: draw the log-probability transfer curve the curve sampler draws tokens
// through (docs/sampling.md, "The curve sampler"), see where a prompt's next-token
// log-probabilities lie under it (POST /signal), and read samples taken under it (POST /generate).
import { apiJson } from "./api.js";
import { announce, markReady } from "./page.js";

const SVG = "http://www.w3.org/2000/svg";
const UMIN = -30;  // mlxd.protocol.curve.CURVE_UMIN: the designer's left edge
const W = 600, H = 300, PAD = 34;
const $ = (id) => document.getElementById(id);
const IDENTITY = [[UMIN, UMIN], [0, 0]];

let points = IDENTITY.map((p) => [...p]);
let bins = null;
let dragging = -1;
let started = false;

// The HLG tone curve (mlxd.protocol.curve.hlg_value) with the top token taken at 0.
function hlgPoints(width = 4, shoulder = 4, toe = 6, pivot = 6) {
  const head = 1 / (1 + shoulder / 4), tail = 1 + toe / 4, s = width / 4;
  const f = (x) => { const z = -(x + pivot) / s; const soft = z > 0 ? z + Math.log1p(Math.exp(-z)) : Math.log1p(Math.exp(z)); return head * x - (tail - head) * s * soft; };
  return [-30, -20, -14, -10, -8, -6, -4, -2, 0].map((x) => [x, Math.round(f(x) * 100) / 100]);
}

const PRESETS = {
  identity: () => IDENTITY,
  "temperature 0.7": () => [[UMIN, UMIN / 0.7], [0, 0]],
  "temperature 1.5": () => [[UMIN, UMIN / 1.5], [0, 0]],
  "HLG defaults": () => hlgPoints(),
};

function yRange() {
  const ys = points.map((p) => p[1]);
  return [Math.min(UMIN, ...ys), Math.max(0, ...ys)];
}
const sx = (u) => PAD + ((u - UMIN) / -UMIN) * (W - 2 * PAD);
const ux = (x) => UMIN + ((x - PAD) / (W - 2 * PAD)) * -UMIN;
function sy(y) { const [lo, hi] = yRange(); return H - PAD - ((y - lo) / (hi - lo || 1)) * (H - 2 * PAD); }
function ys(py) { const [lo, hi] = yRange(); return lo + ((H - PAD - py) / (H - 2 * PAD)) * (hi - lo || 1); }

function node(tag, attrs, text = "") {
  const n = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, String(v));
  if (text) n.textContent = text;
  return n;
}

function draw() {
  const svg = $("curve-plot");
  svg.replaceChildren();
  if (bins) {  // the signal: how many tokens lie at each log-probability, on a log scale
    const top = Math.log1p(Math.max(...bins));
    const bw = (W - 2 * PAD) / bins.length;
    bins.forEach((count, i) => {
      const h = (Math.log1p(count) / (top || 1)) * (H - 2 * PAD);
      if (count) svg.append(node("rect", { x: PAD + i * bw, y: H - PAD - h, width: Math.max(1, bw - 1), height: h, class: "signal" }));
    });
  }
  svg.append(node("line", { x1: PAD, y1: H - PAD, x2: W - PAD, y2: H - PAD, class: "axis" }));
  svg.append(node("line", { x1: PAD, y1: PAD, x2: PAD, y2: H - PAD, class: "axis" }));
  for (const u of [-30, -20, -10, 0]) svg.append(node("text", { x: sx(u), y: H - 8, "text-anchor": "middle", class: "tick" }, String(u)));
  const [lo, hi] = yRange();
  svg.append(node("text", { x: 4, y: PAD - 6, class: "tick" }, hi.toFixed(1)));
  svg.append(node("text", { x: 4, y: H - PAD + 14, class: "tick" }, lo.toFixed(1)));
  svg.append(node("line", { x1: sx(UMIN), y1: sy(UMIN), x2: sx(0), y2: sy(0), class: "identity" }));
  svg.append(node("polyline", { points: points.map(([u, y]) => `${sx(u)},${sy(y)}`).join(" "), class: "curve" }));
  points.forEach(([u, y], i) => {
    const dot = node("circle", { cx: sx(u), cy: sy(y), r: 7, class: "handle", tabindex: 0, role: "slider",
                                 "aria-label": `Point ${i + 1}: log-probability ${u.toFixed(1)}, output ${y.toFixed(2)}`,
                                 "aria-valuenow": y.toFixed(2) });
    dot.addEventListener("pointerdown", (ev) => { dragging = i; dot.setPointerCapture(ev.pointerId); });
    dot.addEventListener("keydown", (ev) => nudge(ev, i));
    dot.addEventListener("dblclick", () => removePoint(i));
    svg.append(dot);
  });
  $("curve-json").value = JSON.stringify({ points });
}

// The curve must never fall (the server refuses one that does): a moved point is held between its neighbours.
function place(i, u, y) {
  const first = i === 0, last = i === points.length - 1;
  const left = first ? UMIN : points[i - 1][0] + 0.1, right = last ? 0 : points[i + 1][0] - 0.1;
  const below = first ? -Infinity : points[i - 1][1], above = last ? Infinity : points[i + 1][1];
  points[i] = [Math.round(Math.min(right, Math.max(left, u)) * 10) / 10, Math.round(Math.min(above, Math.max(below, y)) * 100) / 100];
  draw();
}

function nudge(ev, i) {
  const step = ev.shiftKey ? 1 : 0.1;
  const moves = { ArrowUp: [0, step], ArrowDown: [0, -step], ArrowLeft: [-step, 0], ArrowRight: [step, 0] };
  if (ev.key === "Delete" || ev.key === "Backspace") { removePoint(i); ev.preventDefault(); return; }
  if (!moves[ev.key]) return;
  ev.preventDefault();
  place(i, points[i][0] + moves[ev.key][0], points[i][1] + moves[ev.key][1]);
  $("curve-plot").querySelectorAll("circle")[i]?.focus();
}

function removePoint(i) {
  if (points.length <= 2) return;
  points.splice(i, 1);
  draw();
}

function svgPoint(ev) {
  const r = $("curve-plot").getBoundingClientRect();
  return [(ev.clientX - r.left) * (W / r.width), (ev.clientY - r.top) * (H / r.height)];
}

function addPoint(ev) {
  if (ev.target.tagName === "circle") return;
  const [x, y] = svgPoint(ev);
  const u = ux(x);
  if (u <= UMIN || u >= 0 || points.length >= 64) return;
  const at = points.findIndex((p) => p[0] > u);
  points.splice(at, 0, [u, ys(y)]);
  place(at, u, ys(y));
}

async function readSignal() {
  try {
    const out = await apiJson("/signal", { method: "POST", body: { model: $("curve-model").value || undefined, prompt: $("curve-prompt").value } });
    bins = out.bins;
    $("curve-top").textContent = out.top.map((t) => `${JSON.stringify(t.text)} ${t.logprob.toFixed(2)}`).join(" · ");
    draw();
  } catch (e) { announce(`Signal failed: ${e.message}`, "error"); }
}

async function generate(useDefault) {
  const list = $("curve-samples");
  const button = useDefault ? $("curve-default") : $("curve-generate");
  button.disabled = true;
  try {
    const seed = $("curve-seed").value === "" ? undefined : Number($("curve-seed").value);
    const out = await apiJson("/generate", { method: "POST", body: {
      model: $("curve-model").value || undefined, prompt: $("curve-prompt").value, curve: { points },
      n: Number($("curve-n").value) || 3, max_tokens: Number($("curve-max").value) || 80, seed, default: useDefault } });
    list.replaceChildren(...out.samples.map((s) => {
      const li = document.createElement("li");
      li.textContent = s.text || "(empty)";
      if (s.junk) li.classList.add("junk");
      li.title = s.junk ? "Looks like junk (other scripts, replacement characters)" : "";
      return li;
    }));
    const recipe = out.recipe ? ` (${Object.entries(out.recipe).map(([k, v]) => `${k} ${v}`).join(", ")})` : "";
    $("curve-mode").textContent = `${out.mode}${recipe}, seed ${out.seed}`;
  } catch (e) { announce(`Generate failed: ${e.message}`, "error"); }
  finally { button.disabled = false; }
}

async function fillModels() {
  try {
    const { data } = await apiJson("/v1/models");
    const select = $("curve-model");
    const keep = select.value;
    select.replaceChildren(...data.filter((m) => !(m.capabilities ?? []).includes("embedding")).map((m) => {
      const o = document.createElement("option");
      o.value = m.id;
      o.textContent = m.id;
      return o;
    }));
    if (keep) select.value = keep;
  } catch (e) { announce(`Could not list the models: ${e.message}`, "error"); }
  markReady();
}

export function openCurves() {
  fillModels();
  if (started) return;
  started = true;
  $("curve-settings").addEventListener("submit", (ev) => ev.preventDefault());
  const svg = $("curve-plot");
  svg.addEventListener("pointermove", (ev) => { if (dragging >= 0) { const [x, y] = svgPoint(ev); place(dragging, ux(x), ys(y)); } });
  svg.addEventListener("pointerup", () => { dragging = -1; });
  svg.addEventListener("dblclick", addPoint);
  const presets = $("curve-preset");
  presets.replaceChildren(...Object.keys(PRESETS).map((name) => { const o = document.createElement("option"); o.value = o.textContent = name; return o; }));
  presets.addEventListener("change", () => { points = PRESETS[presets.value]().map((p) => [...p]); draw(); });
  $("curve-signal").addEventListener("click", readSignal);
  $("curve-generate").addEventListener("click", () => generate(false));
  $("curve-default").addEventListener("click", () => generate(true));
  $("curve-copy").addEventListener("click", async () => {
    try { await navigator.clipboard.writeText($("curve-json").value); announce("Curve copied."); }
    catch { $("curve-json").select(); announce("Select and copy the curve's JSON below."); }
  });
  draw();
}
