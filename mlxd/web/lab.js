// The lab view: its jobs (jobs.js) and the forms that start them: fine-tune, quantize, make a
// dataset, fuse, merge, push to the hub, and the Hugging Face token. A part whose route this
// mlxd lacks (an older server) says so and stays off, and the rest of the page works.
import { apiJson, isMissingRoute } from "./api.js";
import { datasetReport, modelReport } from "./inspect.js";
import { jobSubject, showJob, startJobs, stopJobs } from "./jobs.js";
import { announce, confirmAction, el } from "./page.js";

const TOKEN_ROUTE = "/lab/settings/hf-token";
const lists = { model: [], adapter: [], dataset: [] };  // names offered per kind, for the push form
let templates = [];
let wired = false;
const $ = (id) => document.getElementById(id);

// Each form: its route, and its fields' values (formBody) made into the route's body.
const FORMS = {
  "ft-form": ["/lab/finetune", "fine-tune", (b) => b],
  "qz-form": ["/lab/quantize", "quantization", (b) => (b.candidate_bits
    ? { ...b, candidate_bits: String(b.candidate_bits).split(",").map((w) => Number(w.trim())) } : b)],
  "ds-form": ["/lab/dataset", "dataset", (b) => ({ inputs: {}, ...b })],
  "fu-form": ["/lab/fuse", "fuse", (b) => b],
  "mg-form": ["/lab/merge", "merge", (b) => ({
    adapters: [b.adapter_a, b.adapter_b], scales: [b.scale_a ?? 1, b.scale_b ?? 1], name: b.name })],
  "push-form": ["/lab/push", "push", (b) => b],
};

export function startLab() {
  if (!wired) wire();
  wired = true;
  startJobs(() => loadLists());  // a finished job may have made an adapter, a model or a dataset
  loadLists();
  loadTemplates();
  loadToken();
}

export function stopLab() {
  stopJobs();
}

function wire() {
  for (const [id, [path, what, build]] of Object.entries(FORMS)) {
    const form = $(id);
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      submit(form, path, what, build(formBody(form)));
    });
  }
  $("ft-inspect").addEventListener("click", () => inspect("ft", "/lab/finetune/inspect", { data: $("ft-data").value.trim() },
    $("ft-data"), datasetReport));
  $("qz-inspect").addEventListener("click", () => inspect("qz", "/lab/quantize/inspect",
    { model: $("qz-model").value, group_size: Number($("qz-group").value) }, $("qz-model"), modelReport));
  $("ds-template").addEventListener("change", showTemplate);
  $("push-kind").addEventListener("change", fillPushNames);
  $("hf-form").addEventListener("submit", (ev) => { ev.preventDefault(); saveToken(); });
  $("hf-forget").addEventListener("click", forgetToken);
}

/** A form's filled fields as a body: numbers as numbers, checkboxes as booleans, a dataset
 * template's own fields under `inputs`; an empty field is left out (the server's default). */
function formBody(form) {
  const body = {};
  for (const field of form.elements) {
    if (!field.name || field.type === "submit" || field.type === "button" || field.hidden) continue;
    const value = field.type === "checkbox" ? field.checked : field.value.trim();
    if (value === "") continue;
    const typed = field.type === "number" || "number" in field.dataset ? Number(value) : value;
    if ("input" in field.dataset) (body.inputs ??= {})[field.name] = typed;
    else body[field.name] = typed;
  }
  return body;
}

async function submit(form, path, what, body) {
  const button = form.querySelector("button[type=submit]");
  clearError(form);
  button.disabled = true;
  announce(`Submitting the ${what}…`, "busy");
  try {
    const job = await apiJson(path, { method: "POST", body });
    announce(`Queued the ${what}: ${jobSubject(job)}.`);
    showJob(job);
  } catch (e) {
    if (isMissingRoute(e)) setUnavailable(form);
    showError(form, isMissingRoute(e) ? `This mlxd cannot start a ${what} (it has no ${path}).` : e.message, e.param);
    announce(`Could not start the ${what}: ${e.message}`, "error");
  } finally {
    button.disabled = form.classList.contains("off");
  }
}

function clearError(form) {
  form.querySelector(".form-error").hidden = true;
  for (const field of form.querySelectorAll("[aria-invalid]")) field.removeAttribute("aria-invalid");
}

/** The server's message beside the form; the field it blames, when it names one, marked. */
function showError(form, message, param) {
  const box = form.querySelector(".form-error");
  box.textContent = message;
  box.hidden = false;
  const field = param ? form.elements.namedItem(param) : null;
  if (field instanceof HTMLElement) field.setAttribute("aria-invalid", "true");
}

/** A part this mlxd has no route for: said in the form, its fields off. */
function setUnavailable(form) {
  form.classList.add("off");
  form.querySelector(".unavailable")?.removeAttribute("hidden");
  for (const field of form.elements) field.disabled = true;
}

async function inspect(prefix, path, body, field, report) {
  const box = $(`${prefix}-inspection`);
  const button = $(`${prefix}-inspect`);
  if (!field.value.trim()) {
    box.replaceChildren(el("p", "error", `Fill in “${field.labels[0].textContent}” first.`));
    field.focus();
    return;
  }
  box.replaceChildren(el("p", "muted", "Inspecting…"));
  button.disabled = true;
  try {
    box.replaceChildren(...report(await apiJson(path, { method: "POST", body })));
    button.disabled = false;
  } catch (e) {
    const missing = isMissingRoute(e);
    box.replaceChildren(el("p", missing ? "muted" : "error", missing ? "This mlxd cannot inspect (it has no such route)." : e.message));
    button.disabled = missing;
  }
}

/** Fill a select with [value, text] pairs, keeping its choice when it is still offered. */
function fillSelect(select, items, none) {
  const keep = select.value;
  const options = items.map(([value, text]) => {
    const option = el("option", "", text);
    option.value = value;
    return option;
  });
  if (!options.length && none) options.push(Object.assign(el("option", "", none), { value: "" }));
  select.replaceChildren(...options);
  if (items.some(([value]) => value === keep)) select.value = keep;
}

function fillDatalist(list, items) {
  list.replaceChildren(...items.map(([value, label]) => Object.assign(el("option"), { value, label })));
}

async function loadLists() {
  const [models, adapters, datasets] = await Promise.allSettled([apiJson("/v1/models", { quiet: true }),
    apiJson("/v1/adapters", { quiet: true }), apiJson("/lab/datasets", { quiet: true })]);
  if (models.status === "fulfilled") {
    lists.model = models.value.data.map((m) => m.id);
    for (const select of document.querySelectorAll("select.lab-model")) {
      fillSelect(select, lists.model.map((id) => [id, id]), "no models yet");
    }
  }
  if (adapters.status === "fulfilled") {
    const data = adapters.value.data;
    lists.adapter = data.map((a) => a.id);
    const items = data.map((a) => [a.id, `${a.id} (${a.kind}${a.base_model ? `, for ${a.base_model}` : ""})`]);
    for (const select of document.querySelectorAll("select.lab-adapter")) fillSelect(select, items, "no adapters yet");
    if ($("mg-a").value === $("mg-b").value && items.length > 1) $("mg-b").value = items.find(([id]) => id !== $("mg-a").value)[0];
  }
  if (datasets.status === "fulfilled") {
    const data = datasets.value.data;
    lists.dataset = data.map((d) => d.name);
    fillDatalist($("ft-datasets"), data.map((d) => [d.name, `${rowsText(d.rows)}, ${d.format ?? "unknown"} format`]));
  }
  fillPushNames();
}

/** "train 90, valid 10 rows" (rows per split file), or "100 rows". */
function rowsText(rows) {
  if (rows && typeof rows === "object") return `${Object.entries(rows).map(([split, n]) => `${split} ${n}`).join(", ")} rows`;
  return `${rows ?? "?"} rows`;
}

function fillPushNames() {
  fillDatalist($("push-names"), lists[$("push-kind").value].map((name) => [name, name]));
}

async function loadTemplates() {
  if (templates.length || $("ds-form").classList.contains("off")) return;
  try {
    templates = (await apiJson("/lab/dataset/templates", { quiet: true })).data;
  } catch (e) {
    if (isMissingRoute(e)) setUnavailable($("ds-form"));
    else showError($("ds-form"), `Could not read the templates: ${e.message}`);
    return;
  }
  clearError($("ds-form"));  // an earlier refusal (no key yet) is over
  fillSelect($("ds-template"), templates.map((t) => [t.id, t.name]), "no templates");
  showTemplate();
}

/** The chosen template's description, and a field for each of its inputs. */
function showTemplate() {
  const template = templates.find((t) => t.id === $("ds-template").value);
  $("ds-template-about").textContent = template ? `${template.description} (${template.format} rows)` : "";
  $("ds-inputs").replaceChildren(...(template?.inputs ?? []).map(inputField));
}

function inputField(spec) {
  const id = `ds-input-${spec.name}`;
  const field = el("div", spec.type === "integer" ? "field narrow" : "field grow");
  const words = spec.name.replaceAll("_", " ");
  const label = el("label", "", words[0].toUpperCase() + words.slice(1));
  label.htmlFor = id;
  const input = el("input");
  Object.assign(input, { id, name: spec.name, required: Boolean(spec.required), spellcheck: false, autocomplete: "off" });
  input.dataset.input = "";
  if (spec.type === "integer") Object.assign(input, { type: "number", step: "1", inputMode: "numeric" });
  if (spec.default !== null && spec.default !== undefined) input.value = String(spec.default);
  field.append(label, input);
  if (spec.description) {
    const hint = el("span", "hint", spec.description);
    hint.id = `${id}-hint`;
    input.setAttribute("aria-describedby", hint.id);
    field.append(hint);
  }
  return field;
}

async function loadToken() {
  if ($("hf-form").classList.contains("off")) return;
  try {
    showToken(await apiJson(TOKEN_ROUTE, { quiet: true }));
  } catch (e) {
    if (isMissingRoute(e)) setUnavailable($("hf-form"));
    else $("hf-status").textContent = `Could not read whether a token is saved: ${e.message}`;
  }
}

/** Whether a token is kept (GET /lab/settings/hf-token's answer); never the token. */
function showToken(state) {
  const fromEnv = state.has_token && state.source === "env";
  $("hf-status").textContent = !state.has_token
    ? "No token is saved. Pushing needs one: a write token from huggingface.co/settings/tokens."
    : fromEnv ? "The server has a token from its environment (HF_TOKEN); pushes use it. A saved token would replace it."
      : "A token is saved; pushes use it.";
  $("hf-forget").disabled = !state.has_token || fromEnv;
}

// The token goes to the server and is never shown again: the field is emptied either way.
async function saveToken() {
  const form = $("hf-form");
  const input = $("hf-token");
  const token = input.value.trim();
  input.value = "";
  clearError(form);
  if (!token) return;
  try {
    showToken(await apiJson(TOKEN_ROUTE, { method: "POST", body: { token } }));
    announce("The Hugging Face token is saved.");
  } catch (e) {
    showError(form, e.message);
    announce(`Could not save the token: ${e.message}`, "error");
  }
}

async function forgetToken() {
  if (!await confirmAction("Forget the saved Hugging Face token? Pushing needs one again.", "Forget")) return;
  try {
    showToken(await apiJson(TOKEN_ROUTE, { method: "DELETE" }));
    announce("The Hugging Face token is forgotten.");
  } catch (e) {
    showError($("hf-form"), e.message);
    announce(`Could not forget the token: ${e.message}`, "error");
  }
}
