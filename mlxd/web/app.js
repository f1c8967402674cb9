// The page's entry: hash routing between the dashboard, the chat and the lab, and the key button.
import { askKey, forgetKey, getKey, onKeyChange } from "./api.js";
import { openChat } from "./chat.js";
import { openCurves } from "./curves.js";
import { startDashboard, stopDashboard } from "./dashboard.js";
import { announce } from "./page.js";

const VIEWS = ["dashboard", "chat", "lab", "curves"];
const TITLES = { dashboard: "Dashboard", chat: "Chat", lab: "Lab", curves: "Curve designer" };
// The lab's modules load when it is first opened: the dashboard's first load stays as small.
let lab = null;

function currentView() {
  const name = location.hash.slice(1);
  return VIEWS.includes(name) ? name : "dashboard";
}

function route() {
  const name = currentView();
  for (const view of VIEWS) {
    document.getElementById(`view-${view}`).hidden = view !== name;
    const link = document.querySelector(`nav a[data-view=${view}]`);
    if (view === name) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  document.title = `${TITLES[name]} · mlxd`;
  if (name === "dashboard") startDashboard();
  else stopDashboard();
  if (name === "chat") openChat();
  if (name === "curves") openCurves();
  if (name === "lab") {
    (lab ??= import("./lab.js")).then((m) => m.startLab(), (e) => {
      lab = null;
      announce(`Could not load the lab: ${e.message}`, "error");
    });
  }
  else lab?.then((m) => m.stopLab());
}

function showKeyButton() {
  const button = document.getElementById("key-button");
  const label = getKey() ? "Forget key" : "Enter key";
  button.querySelector(".key-label").textContent = label;  // the accessible name, also on a phone
  button.title = label;
}

document.getElementById("key-button").addEventListener("click", async () => {
  if (getKey()) {
    forgetKey();
    announce("The key is forgotten in this browser.");
  } else if (await askKey("Enter an API key (an admin key also opens the dashboard and the lab).")) {
    announce("Key saved.");
    route();
  }
});
onKeyChange(showKeyButton);
window.addEventListener("hashchange", () => {
  route();
  document.getElementById("main").focus();
});
showKeyButton();
route();
// Installable as an app, and openable while mlxd is down (sw.js: the shell only, never the APIs).
// Browsers allow service workers on https and localhost only; elsewhere the page works as it is.
if ("serviceWorker" in navigator && window.isSecureContext) {
  navigator.serviceWorker.register("/sw.js").catch(() => {});
}
