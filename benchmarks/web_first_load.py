"""The web page's first load: bytes transferred and time to interactive, in headless Chromium.

A supervisor with the tiny random model (loaded, so the dashboard has a ready engine to show)
serves `/`; each run opens it in a fresh browser context (cold cache) and reports
  * bytes: the sum of the response bodies of every request the page made (as sent, so after
    any compression), and the headers separately;
  * domInteractive: navigation start to the HTML parsed (the browser's own timing);
  * ready: navigation start to the page's own mark `mlxd-ready`, set once the first data
    (the pool, or the model list for the chat) is on screen;
  * baseline_ms: in the same run, before each load, a fresh context's navigation to `/health`
    (a few bytes of JSON), to its load event: the floor of any page from the daemon; and
    ready_over_baseline, the ratio of the medians.
Medians over the runs, for the dashboard (`/`) and the chat (`/#chat`).

`--screenshots DIR` also writes the docs' screenshots (dashboard and chat, desktop and phone)
with SmolLM2-135M-Instruct, so the chat shows real text.

  python benchmarks/web_first_load.py
  python benchmarks/web_first_load.py --runs 11
  python benchmarks/web_first_load.py --screenshots docs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx
from playwright.sync_api import Browser, Page, sync_playwright

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy_overhead import Supervisor, private_dir  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
TIMINGS = """() => ({
  domInteractive: performance.getEntriesByType('navigation')[0].domInteractive,
  ready: performance.getEntriesByName('mlxd-ready')[0].startTime,
})"""


def start_supervisor(work: Path, models: dict[str, Path]) -> Supervisor:
    """A supervisor serving `models` (id -> dir), each loaded."""
    config = work / "config.toml"
    config.write_text("".join(f'[models."{name}"]\npath = "{path}"\n' for name, path in models.items()))
    sup = Supervisor(config, private_dir(work / "data"), private_dir(Path(tempfile.mkdtemp(prefix="mx-"))), work / "sup.log")
    sup.wait_health()
    for name in models:
        httpx.post(sup.url + "/admin/load", json={"model": name}, timeout=300).raise_for_status()
    return sup


def first_load(browser: Browser, url: str) -> dict[str, float]:
    """One cold load of `url` in a fresh context: bytes and timings."""
    context = browser.new_context()
    page = context.new_page()
    finished: list[Any] = []
    page.on("requestfinished", lambda request: finished.append(request))
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", timeout=60_000)
    timings = page.evaluate(TIMINGS)
    sizes = [r.sizes() for r in finished]
    context.close()
    return {"requests": len(sizes), "body_bytes": sum(s["responseBodySize"] for s in sizes),
            "header_bytes": sum(s["responseHeadersSize"] for s in sizes), **timings}


def floor_load(browser: Browser, base: str) -> float:
    """The baseline: a fresh context's navigation to `/health` (a few bytes of JSON from the same
    daemon), navigation start to its load event: what any page from mlxd costs at the least."""
    context = browser.new_context()
    page = context.new_page()
    page.goto(base + "/health")
    loaded = float(page.evaluate("performance.getEntriesByType('navigation')[0].loadEventEnd"))
    context.close()
    return loaded


def measure(browser: Browser, url: str, runs: int) -> dict[str, float]:
    """Medians of `runs` cold loads (one warm-up load first, not counted), each after a baseline load."""
    base = url.split("/#")[0].rstrip("/")
    first_load(browser, url)
    rows = []
    for _ in range(runs):
        floor = floor_load(browser, base)
        rows.append({**first_load(browser, url), "baseline_ms": floor})
    medians = {key: round(statistics.median(r[key] for r in rows), 1) for key in rows[0]}
    medians["ready_over_baseline"] = round(medians["ready"] / medians["baseline_ms"], 2)
    return medians


def ask(page: Page, text: str) -> None:
    page.fill("#chat-temperature", "0.3")
    page.fill("#chat-max-tokens", "200")
    page.fill("#chat-prompt", text)
    page.press("#chat-prompt", "Enter")
    page.wait_for_selector("#messages > li:last-child[data-done]", timeout=300_000)


def traffic(url: str, num: int) -> None:
    """A few streamed answers from the tiny model, so the dashboard's charts have two lines."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 400,
            "temperature": 0, "stream": True}
    for _ in range(num):
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
            for _line in resp.iter_lines():
                pass
        time.sleep(1)


def fit_to_content(page: Page, width: int) -> None:
    """Make the viewport as tall as the page: only main scrolls (the header and the status line
    hold their rows), so a full-page screenshot would show just the viewport."""
    height = page.evaluate("""() => {
      const main = document.getElementById('main');
      return document.body.clientHeight - main.clientHeight + main.scrollHeight;
    }""")
    page.set_viewport_size({"width": width, "height": height})


def screenshots(browser: Browser, url: str, out: Path) -> None:
    """The docs' screenshots: dashboard after some traffic, and a real chat (SmolLM2)."""
    traffic(url, 5)
    for name, viewport, scale in (("", {"width": 1200, "height": 900}, 1), ("-phone", {"width": 390, "height": 844}, 2)):
        context = browser.new_context(viewport=viewport, device_scale_factor=scale, color_scheme="light")
        page = context.new_page()
        page.goto(url + "/#chat")
        page.wait_for_selector("body[data-ready='1']")
        page.select_option("#chat-model", "SmolLM2-135M-Instruct")
        ask(page, "What is MLX, in two sentences?")
        ask(page, "Write a Python function that reverses a string, with a short explanation.")
        if name == "":
            fit_to_content(page, viewport["width"])
        page.screenshot(path=str(out / f"web-chat{name}.png"))
        page.goto(url + "/#dashboard")
        page.wait_for_selector("[data-model=tiny] .badge")
        time.sleep(2.5)  # one more poll, so the charts hold the chat's traffic
        if name == "":
            page.set_viewport_size(viewport)
            fit_to_content(page, viewport["width"])
        page.screenshot(path=str(out / f"web-dashboard{name}.png"))
        context.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--screenshots", type=Path, help="write the docs' screenshots into this dir")
    args = parser.parse_args()
    from mlxd.engine.models.random_model import build_random_llama

    work = Path(tempfile.mkdtemp(prefix="mlxd-web-"))
    models = {"tiny": build_random_llama(work / "tiny", context=4096)}
    if args.screenshots:
        from mlxd.engine.models.importer import import_default

        models["SmolLM2-135M-Instruct"] = import_default(work / "models")
    sup = start_supervisor(work, models)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # fatal in Chromium's GPU process
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, env=env)
            result = {"dashboard": measure(browser, sup.url + "/", args.runs),
                      "chat": measure(browser, sup.url + "/#chat", args.runs), "runs": args.runs}
            print(json.dumps(result, indent=2))
            if args.screenshots:
                screenshots(browser, sup.url, args.screenshots)
            browser.close()
    finally:
        sup.stop()


if __name__ == "__main__":
    main()
