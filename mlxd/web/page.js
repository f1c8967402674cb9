// Page-wide bits: the status line, the confirmation dialog, the "ready" mark for tests and benchmarks.

/** Say `message` in the status line (an aria-live region), as success or error. */
export function announce(message, kind = "ok") {
  const status = document.getElementById("status");
  status.textContent = message;
  status.dataset.kind = kind;
}

/** Ask a yes/no question in a modal dialog; true for yes. */
export function confirmAction(question, yesLabel) {
  const dialog = document.getElementById("confirm-dialog");
  dialog.querySelector(".question").textContent = question;
  dialog.querySelector("button[value=yes]").textContent = yesLabel;
  dialog.returnValue = "";
  dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "yes"), { once: true });
  });
}

/** The first data is on screen: benchmarks/web_first_load.py and the tests wait for this. */
export function markReady() {
  if (document.body.dataset.ready) return;
  document.body.dataset.ready = "1";
  performance.mark("mlxd-ready");
}

/** `tag` with `className` and text, for building the page without innerHTML. */
export function el(tag, className = "", text = "") {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text) node.textContent = text;
  return node;
}
