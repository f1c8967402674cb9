// What the lab's "Inspect" buttons show: a dataset's files and bad lines, a model's size and
// what each quantization would make of it.
import { el } from "./page.js";
import { formatBytes } from "./units.js";

/** "135M", "1.2B": a count of parameters. */
export function formatCount(n) {
  if (n === null || n === undefined) return "–";
  for (const [size, unit] of [[1e12, "T"], [1e9, "B"], [1e6, "M"], [1e3, "K"]]) {
    if (n >= size) return `${(n / size).toFixed(n >= 100 * size ? 0 : 1)}${unit}`;
  }
  return String(n);
}

function table(caption, head, rows) {
  const wrap = el("div", "table-wrap");
  const t = el("table");
  t.append(el("caption", "", caption));
  const tr = el("tr");
  tr.append(...head.map((h) => {
    const th = el("th", "", h);
    th.scope = "col";
    return th;
  }));
  const thead = el("thead");
  thead.append(tr);
  const tbody = el("tbody");
  tbody.append(...rows.map((cells) => {
    const row = el("tr");
    row.append(...cells.map((c) => el("td", "", String(c))));
    return row;
  }));
  t.append(thead, tbody);
  wrap.append(t);
  return wrap;
}

/** The nodes for POST /lab/finetune/inspect's answer. */
export function datasetReport(r) {
  const verdict = r.ok
    ? el("p", "result", `It can be trained on: ${r.path}`)
    : el("p", "error", `It cannot be trained on: ${r.error || "see the bad lines below"}`);
  const files = r.files || [];
  const nodes = [verdict];
  if (files.length) {
    nodes.push(table("Files", ["Split", "Rows", "Format", "Bad lines"],
      files.map((f) => [f.split, f.rows ?? "–", f.format ?? "–", f.num_bad ?? 0])));
  }
  for (const f of files.filter((x) => (x.bad || []).length)) {
    const list = el("ul", "bad-lines");
    list.setAttribute("aria-label", `Bad lines in ${f.split}`);
    list.append(...f.bad.map((b) => el("li", "", `${f.split} line ${b.line}: ${b.reason}`)));
    if (f.num_bad > f.bad.length) list.append(el("li", "muted", `and ${f.num_bad - f.bad.length} more`));
    nodes.push(list);
  }
  return nodes;
}

/** The nodes for POST /lab/quantize/inspect's answer. */
export function modelReport(r) {
  const facts = [r.model_type, `${formatCount(r.parameters)} parameters`, r.layers ? `${r.layers} layers` : "", r.dtype,
    formatBytes(r.size_bytes),
    r.quantized ? "quantized already: quantize the full-precision model" : "not quantized"].filter(Boolean);
  const nodes = [el("p", r.quantized ? "error" : "", `${r.model}: ${facts.join(" · ")}`)];
  const estimates = r.estimates || [];
  if (estimates.length) {
    nodes.push(table("What a quantization would make", ["Bits", "Group size", "Bits per weight", "Size"],
      estimates.map((e) => [e.bits, e.group_size ?? "–", e.bits_per_weight?.toFixed(2) ?? "–", formatBytes(e.size_bytes)])));
  }
  return nodes;
}
