// The chat view: streamed answers from POST /v1/chat/completions, rendered as Markdown.
import { ApiError, api, apiJson } from "./api.js";
import { attachments, clearAttachments, imagesView, messageContent, wireAttach } from "./attach.js";
import { renderMarkdown } from "./markdown.js";
import { announce, el, markReady } from "./page.js";
import { makeLoadView } from "./progress.js";
import { sseData } from "./stream.js";
import { formatRate } from "./units.js";

const MODEL_ITEM = "mlxd.chatModel";
const LOAD_POLL_MS = 500;
const history = [];  // this conversation's {role, content} messages, answers included
let controller = null;  // the answer streaming now, if any
let wired = false;
const $ = (id) => document.getElementById(id);

export async function openChat() {
  if (!wired) wire();
  wired = true;
  await loadModels();
  markReady();
}

function wire() {
  $("chat-form").addEventListener("submit", (ev) => { ev.preventDefault(); send(); });
  $("chat-prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      send();
    }
  });
  $("chat-stop").addEventListener("click", () => controller?.abort());
  $("chat-clear").addEventListener("click", clearChat);
  $("chat-model").addEventListener("change", (ev) => localStorage.setItem(MODEL_ITEM, ev.target.value));
  $("messages").addEventListener("click", copyCode);
  wireAttach();
}

async function loadModels() {
  const select = $("chat-model");
  try {
    const [{ data }, adapters] = await Promise.all([apiJson("/v1/models"), listAdapters()]);
    const chosen = select.value || localStorage.getItem(MODEL_ITEM);
    const groups = data.map((m) => [m, adapters.filter((a) => isAdapterFor(a, m.id))]).filter(([, list]) => list.length);
    select.replaceChildren(...data.map(modelOption), ...groups.map(([m, list]) => adapterGroup(m, list)));
    const values = [...select.options].map((o) => o.value);
    const pick = values.includes(chosen) ? chosen : (data.find((m) => m.loaded) || data[0])?.id;
    if (pick) select.value = pick;
    else announce("No models found: add one with mlxd pull.", "error");
  } catch (e) {
    announce(`Could not list the models: ${e.message}`, "error");
  }
}

function modelOption(m) {
  const notes = [m.loaded ? "loaded" : "", (m.capabilities ?? []).includes("vision") ? "images" : "",
                 (m.capabilities ?? []).includes("audio") ? "audio" : ""].filter(Boolean);
  const option = el("option", "", notes.length ? `${m.id} (${notes.join(", ")})` : m.id);
  option.value = m.id;
  return option;
}

/** A model's adapters as `MODEL:ADAPTER` ids (the server takes that form), in a group named for the model. */
function adapterGroup(m, adapters) {
  const group = el("optgroup");
  group.label = `Adapters of ${m.id}`;
  group.append(...adapters.map((a) => {
    const loaded = (a.loaded_on ?? []).includes(m.id);
    const option = el("option", "", `${m.id}:${a.id}${loaded ? " (loaded)" : ""}`);
    option.value = `${m.id}:${a.id}`;
    option.dataset.base = m.id;
    return option;
  }));
  return group;
}

async function listAdapters() {
  try {
    return (await apiJson("/v1/adapters", { quiet: true })).data;
  } catch {
    return [];  // an mlxd without adapters: the models alone
  }
}

// The server's own match (supervisor/adapters.py is_for), less its path test (the page does not
// see the models' paths): no recorded base, or the same name without the org, or loaded there.
function isAdapterFor(adapter, modelId) {
  const bare = (name) => name.replace(/\/+$/, "").split("/").pop().toLowerCase();
  const base = adapter.base_model;
  return !base || bare(base) === bare(modelId) || (adapter.loaded_on ?? []).includes(modelId);
}

/** The request for `content` as the next user message; throws on bad settings. */
function requestBody(model, content) {
  const tempRaw = $("chat-temperature").value.trim();
  const temperature = Number(tempRaw);
  if (!tempRaw || !(temperature >= 0 && temperature <= 2)) throw new Error("Temperature must be a number from 0 to 2.");
  const maxRaw = $("chat-max-tokens").value.trim();
  const maxTokens = Number(maxRaw);
  if (maxRaw && !(Number.isInteger(maxTokens) && maxTokens > 0)) throw new Error("Max tokens must be a whole number above 0.");
  const system = $("chat-system").value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...history, { role: "user", content }];
  return { model, messages, temperature, stream: true, stream_options: { include_usage: true },
    ...(maxRaw ? { max_tokens: maxTokens } : {}) };
}

async function send() {
  const prompt = $("chat-prompt");
  const text = prompt.value.trim();
  const model = $("chat-model").value;
  const images = attachments();
  if ((!text && !images.length) || controller) return;
  let body;
  const content = messageContent(text, images);
  try {
    if (!model) throw new Error("Pick a model first.");
    body = requestBody(model, content);
  } catch (e) {
    announce(e.message, "error");
    return;
  }
  prompt.value = "";
  clearAttachments();
  history.push({ role: "user", content });
  const answer = makeAnswer(model);
  $("messages").append(userView(text, images), answer.item);
  scrollToEnd();
  controller = new AbortController();
  setBusy(true);
  const watch = watchLoad($("chat-model").selectedOptions[0]?.dataset.base || model, answer);
  try {
    await streamAnswer(body, answer, controller.signal);
  } catch (e) {
    if (e.name === "AbortError") answer.stopped = true;
    else showError(answer, e.message);
  } finally {
    watch.stop();
    finish(answer);
    controller = null;
    setBusy(false);
    prompt.focus({ preventScroll: true });  // a reader scrolled up to an older answer stays there
  }
}

async function streamAnswer(body, a, signal) {
  a.startedAt = performance.now();
  const resp = await api("/v1/chat/completions", { method: "POST", body, signal });
  for await (const chunk of sseData(resp.body)) {
    if (chunk.error) throw new ApiError(0, chunk.error.message || "The answer broke off.", chunk.error.code);
    if (chunk.usage) a.usage = chunk.usage;
    const choice = chunk.choices?.[0];
    const delta = choice?.delta;
    if (!delta) continue;
    if (delta.content || delta.reasoning_content || delta.tool_calls) {
      a.firstAt ??= performance.now();
      a.chunks++;
    }
    a.text += delta.content || "";
    a.thinking += delta.reasoning_content || "";
    for (const call of delta.tool_calls ?? []) mergeCall(a.calls, call);
    if (a.firstAt) scheduleRender(a);
  }
}

function mergeCall(calls, part) {
  const call = (calls[part.index ?? calls.length] ??= { id: "", name: "", args: "" });
  call.id ||= part.id || "";
  call.name += part.function?.name || "";
  call.args += part.function?.arguments || "";
}

function makeAnswer(model) {
  const a = { item: el("li", "message assistant"), reasoning: el("details", "reasoning"), reasoningText: el("div", "reasoning-text"),
    content: el("div", "content"), tools: el("div", "tools"), waiting: el("div", "waiting"), error: el("p", "error"),
    stats: el("p", "stats"), text: "", thinking: "", calls: [], chunks: 0, frame: 0, stopped: false };
  a.item.setAttribute("aria-busy", "true");
  a.reasoning.hidden = true;
  a.reasoning.append(el("summary", "", "Reasoning"), a.reasoningText);
  a.error.hidden = true;
  a.error.setAttribute("role", "alert");
  a.waiting.replaceChildren(makeLoadView(null, "ready"));
  a.item.append(el("p", "role", model), a.waiting, a.reasoning, a.content, a.tools, a.error, a.stats);
  return a;
}

function userView(text, images) {
  const item = el("li", "message user");
  item.append(el("p", "role", "You"));
  if (images.length) item.append(imagesView(images));
  if (text) item.append(el("div", "content plain", text));
  return item;
}

function scheduleRender(a) {
  if (!a.frame) a.frame = requestAnimationFrame(() => { a.frame = 0; paint(a); });
}

function paint(a) {
  const atEnd = isAtEnd();
  a.waiting.hidden = Boolean(a.firstAt) || !a.item.hasAttribute("aria-busy");
  a.content.innerHTML = renderMarkdown(a.text);  // safe: the renderer escapes all text first
  a.reasoning.hidden = !a.thinking;
  a.reasoningText.textContent = a.thinking;
  a.tools.replaceChildren(...a.calls.map(toolView));
  if (atEnd) scrollToEnd();
}

// main is the page's scroller (app.css); at its end the composer, under the answer, stays in view.
function isAtEnd() {
  const main = $("main");
  return main.scrollTop + main.clientHeight >= main.scrollHeight - 80;
}

function scrollToEnd() {
  const main = $("main");
  main.scrollTop = main.scrollHeight;
}

function toolView(call) {
  const box = el("div", "tool-call");
  const title = el("p", "", "Tool call: ");
  title.append(el("code", "", call.name || "(unnamed)"));
  box.append(title, el("pre", "", call.args));
  return box;
}

function showError(a, message) {
  a.error.hidden = false;
  a.error.textContent = `Error: ${message}`;
  announce(`The answer failed: ${message}`, "error");
}

/** The answer is over (done, stopped or failed): final render, its speed, and the history. */
function finish(a) {
  cancelAnimationFrame(a.frame);
  a.item.removeAttribute("aria-busy");
  a.item.dataset.done = a.stopped ? "stopped" : a.error.hidden ? "done" : "error";
  a.stats.textContent = speedLine(a, performance.now());  // before the paint, which scrolls to the new end
  paint(a);
  if (a.text) history.push({ role: "assistant", content: a.text });
  if (a.error.hidden) announce(a.stopped ? "Stopped; the partial answer is kept." : "Answer finished.");
}

function speedLine(a, endAt) {
  if (!a.firstAt) return a.stopped ? "Stopped before the first token." : "";
  const tokens = a.usage?.completion_tokens ?? a.chunks;
  const parts = [a.stopped ? "Stopped" : null, `${a.usage ? "" : "~"}${tokens} tokens`];
  const decodeS = (endAt - a.firstAt) / 1000;
  if (tokens > 1 && decodeS > 0) parts.push(`${formatRate((tokens - 1) / decodeS)} tokens/s`);
  parts.push(`first token after ${Math.round(a.firstAt - a.startedAt)} ms`);
  return parts.filter(Boolean).join(" · ");
}

/** While the answer waits for its first token, show the model's load progress from /v1/models. */
function watchLoad(model, a) {
  let stopped = false;
  let timer = 0;
  const tick = async () => {
    try {
      const { data } = await apiJson("/v1/models", { quiet: true });
      const m = data.find((x) => x.id === model);
      if (!stopped && !a.firstAt && m) a.waiting.replaceChildren(makeLoadView(m.load ?? null, m.state));
    } catch { /* the answer's own request shows what went wrong */ }
    if (!stopped && !a.firstAt) timer = setTimeout(tick, LOAD_POLL_MS);
  };
  tick();
  return { stop() { stopped = true; clearTimeout(timer); } };
}

function setBusy(busy) {
  $("chat-send").disabled = busy;
  $("chat-stop").disabled = !busy;
  if (busy) announce("Generating…", "busy");
}

function clearChat() {
  controller?.abort();
  history.length = 0;
  $("messages").replaceChildren();
  announce("New chat.");
  $("chat-prompt").focus();
}

async function copyCode(ev) {
  const button = ev.target.closest("button.copy");
  if (!button) return;
  try {
    await navigator.clipboard.writeText(button.parentElement.querySelector("pre").textContent);
    announce("Copied.");
  } catch (e) {
    announce(`Could not copy: ${e.message}`, "error");
  }
}
