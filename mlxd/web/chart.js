// Line charts drawn as inline SVG: one line per model, gaps where a value is null.
const SVG = "http://www.w3.org/2000/svg";
const W = 600, H = 160, PAD_L = 8, PAD_R = 8, PAD_T = 18, PAD_B = 18;

function svgNode(tag, attrs, text = "") {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text) node.textContent = text;
  return node;
}

/** A "nice" top for the y axis: 1, 2 or 5 times a power of ten, at least `max`. */
export function niceMax(max) {
  if (!(max > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(max));
  return [1, 2, 5, 10].map((m) => m * power).find((v) => v >= max);
}

function polylines(values, x, y) {
  const runs = [];
  let run = [];
  values.forEach((v, i) => {
    if (v === null || v === undefined) {
      if (run.length) runs.push(run);
      run = [];
    } else {
      run.push(`${x(i).toFixed(1)},${y(v).toFixed(1)}`);
    }
  });
  if (run.length) runs.push(run);
  return runs;
}

/**
 * Draw `series` ([{name, values, index}]) into `svg`; `spanLabel` names the left edge
 * ("-10 min") and `endLabel` the right one; `format` writes the y axis top.
 */
export function drawChart(svg, series, { spanLabel, endLabel = "now", format, label }) {
  svg.replaceChildren();
  const count = Math.max(1, ...series.map((s) => s.values.length));
  const max = niceMax(Math.max(0, ...series.flatMap((s) => s.values.filter((v) => v !== null))));
  const x = (i) => PAD_L + ((W - PAD_L - PAD_R) * i) / Math.max(1, count - 1);
  const y = (v) => H - PAD_B - ((H - PAD_T - PAD_B) * v) / max;
  for (const frac of [0, 0.5, 1]) {
    const gy = y(max * frac);
    svg.append(svgNode("line", { x1: PAD_L, x2: W - PAD_R, y1: gy, y2: gy, class: "grid" }));
  }
  svg.append(svgNode("text", { x: PAD_L, y: PAD_T - 5, class: "axis" }, format(max)));
  svg.append(svgNode("text", { x: PAD_L, y: H - 4, class: "axis" }, spanLabel));
  svg.append(svgNode("text", { x: W - PAD_R, y: H - 4, class: "axis", "text-anchor": "end" }, endLabel));
  for (const s of series) {
    for (const run of polylines(s.values, x, y)) {
      const tag = run.length === 1 ? "circle" : "polyline";
      const [cx, cy] = run[0].split(",");
      const attrs = tag === "circle" ? { cx, cy, r: 2.5 } : { points: run.join(" ") };
      svg.append(svgNode(tag, { ...attrs, class: `series series-${s.index % 6}` }));
    }
  }
  svg.setAttribute("aria-label", label);
}
