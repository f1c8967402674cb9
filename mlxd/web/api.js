// Calls from the page to mlxd: the API key (kept in localStorage) and errors as ApiError.
const KEY_ITEM = "mlxd.apiKey";
const keyListeners = new Set();
let asking = null;  // the open key dialog: concurrent 401s share one question
let declined = false;  // cancelled: background polls stop asking until the user chooses to

export class ApiError extends Error {
  constructor(status, message, code, param) {
    super(message);
    this.status = status;
    this.code = code;
    this.param = param;  // the request field the server blames, when it names one
  }
}

/** Whether `e` says this mlxd has no such route (an older server, or a part not built yet). */
export function isMissingRoute(e) {
  return e instanceof ApiError && ((e.status === 404 && e.code === "not_found") || e.status === 405);
}

export function getKey() {
  return localStorage.getItem(KEY_ITEM) || "";
}

export function forgetKey() {
  localStorage.removeItem(KEY_ITEM);
  keyListeners.forEach((fn) => fn());
}

export function onKeyChange(fn) {
  keyListeners.add(fn);
}

/** Ask for a key in the key dialog; true once one is saved. 401s that come together (the
 * dashboard's polls) share one question, which says the strongest need among them: an admin
 * key, when any of them wanted one, whichever answer came first. */
export function askKey(reason, needsAdmin = false) {
  if (!asking) {
    asking = showKeyDialog(reason).finally(() => { asking = null; });
  } else if (needsAdmin) {
    document.querySelector("#key-dialog .reason").textContent = reason;
  }
  return asking;
}

function showKeyDialog(reason) {
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  dialog.querySelector(".reason").textContent = reason;
  const form = dialog.querySelector("form");
  let choice = "";  // Enter in the field submits with no submitter (returnValue stays empty): that is "save"
  const onSubmit = (ev) => { choice = ev.submitter?.value || "save"; };
  input.value = "";
  form.addEventListener("submit", onSubmit);
  dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      form.removeEventListener("submit", onSubmit);
      const key = choice === "save" ? input.value.trim() : "";
      if (key) localStorage.setItem(KEY_ITEM, key);
      declined = !key;
      keyListeners.forEach((fn) => fn());
      resolve(Boolean(key));
    }, { once: true });
  });
}

// The dashboard's and the lab's routes take an admin key where keys are configured.
function isAdminPath(path) {
  return path.startsWith("/admin/") || path.startsWith("/lab/");
}

function keyReason(path) {
  return isAdminPath(path)
    ? "This needs an admin key (one of server.admin_keys, or an API key when no admin keys are set)."
    : "mlxd needs an API key (server.api_keys).";
}

function headersFor(body) {
  const headers = {};
  const key = getKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  return headers;
}

/** The server's error as an ApiError: its `error.message` when it sent one. */
export async function errorOf(resp) {
  let text = "";
  try { text = await resp.text(); } catch { /* the body broke off: the status still says enough */ }
  try {
    const err = JSON.parse(text).error;
    if (err && err.message) return new ApiError(resp.status, err.message, err.code, err.param);
  } catch { /* not JSON */ }
  return new ApiError(resp.status, `${resp.status} ${resp.statusText} ${text.slice(0, 200)}`.trim());
}

/**
 * fetch() with the key; on a 401 ask for a key once and retry. A 401 to a call sent before
 * a key was saved (a poll that was out while the dialog was answered) goes again with the
 * new key instead of asking again. `quiet` calls (background polls) do not ask again after
 * the user cancelled the dialog.
 */
export async function api(path, { method = "GET", body, signal, quiet = false } = {}) {
  let asked = false;
  for (;;) {
    const sent = getKey();
    const resp = await fetch(path, {
      method, signal, headers: headersFor(body), body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (resp.status === 401 && getKey() && getKey() !== sent) continue;
    if (resp.status === 401 && !asked && !(quiet && declined)) {
      asked = true;
      if (await askKey(keyReason(path), isAdminPath(path))) continue;
    }
    if (!resp.ok) throw await errorOf(resp);
    return resp;
  }
}

export async function apiJson(path, options) {
  return (await api(path, options)).json();
}
