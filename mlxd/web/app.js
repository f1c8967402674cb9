// The page's entry: hash routing between the dashboard and the chat, and the key button.
import { askKey, forgetKey, getKey, onKeyChange } from "./api.js";
import { openChat } from "./chat.js";
import { startDashboard, stopDashboard } from "./dashboard.js";
import { announce } from "./page.js";

const VIEWS = ["dashboard", "chat"];

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
  document.title = `${name === "chat" ? "Chat" : "Dashboard"} · mlxd`;
  if (name === "dashboard") startDashboard();
  else stopDashboard();
  if (name === "chat") openChat();
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
  } else if (await askKey("Enter an API key (an admin key also opens the dashboard).")) {
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
