// A view's polling: `refresh` every `everyMs` while the view is shown and the tab is visible,
// never two at once; a tab shown again, or `soon(0)`, refreshes at once.
export function makePoller(refresh, everyMs) {
  let timer = 0;
  let active = false;
  let running = false;

  async function tick() {
    if (!active || document.hidden || running) return;
    running = true;
    try {
      await refresh();
    } finally {
      running = false;
    }
    if (active && !document.hidden) soon(everyMs);
  }

  function soon(ms) {
    clearTimeout(timer);
    timer = setTimeout(tick, ms);
  }

  document.addEventListener("visibilitychange", () => { if (active && !document.hidden) soon(0); });
  return {
    start() { active = true; soon(0); },
    stop() { active = false; clearTimeout(timer); },
    soon,
    get active() { return active; },
  };
}
