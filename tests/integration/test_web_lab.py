"""The web page's lab view and the chat's adapters, in headless Chromium against a real supervisor
serving the tiny model with two random-weight adapters (mlxd/web/lab.js, jobs.js, chat.js).

A merge is the lab job the test submits: it reads only adapter files, so it runs in seconds
without loading a model. Skipped where Debian's Chromium is missing (`apt-get install chromium`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Response, sync_playwright

from tests.support import SupervisorProcess, serving

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's Chromium at /usr/bin/chromium "
                                                              "(apt-get install chromium)")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
PHONE = {"width": 390, "height": 844}
OVERFLOW = """() => [document.documentElement, document.getElementById('main')]
  .map((e) => e.scrollWidth - e.clientWidth)"""


@pytest.fixture(scope="module")
def sup(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    from mlxd.engine.models.random_adapter import build_random_adapter

    data = tmp_path_factory.mktemp("web-lab")
    for seed, name in enumerate(("alpha", "beta")):
        build_random_adapter(tiny_model, data / "adapters" / name, rank=2, seed=seed, base_model="tiny")
    with serving(tiny_model, "tiny", data) as proc:
        yield proc


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    # `make test` preloads OpenBLAS for MLX; in Chromium's GPU process it is fatal.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, env=env)
        yield browser
        browser.close()


def watch(page: Page, problems: list[str]) -> None:
    """Collect the page's console errors and warnings, script errors and HTTP errors, each with its URL."""
    def on_console(m: ConsoleMessage) -> None:
        if m.type in ("error", "warning"):
            problems.append(f"console: {m.text} at {m.location.get('url', '')}")

    def on_response(r: Response) -> None:
        if r.status >= 400:
            problems.append(f"HTTP {r.status}: {r.request.method} {r.url}")

    page.on("console", on_console)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"failed: {r.url} {r.failure}"))
    page.on("response", on_response)


def test_a_merge_submitted_from_the_lab_succeeds_and_a_taken_name_is_refused(
    sup: SupervisorProcess, browser: Browser
) -> None:
    context = browser.new_context(viewport=PHONE, device_scale_factor=2, is_mobile=True, has_touch=True)
    context.set_default_timeout(30_000)
    problems: list[str] = []
    try:
        page = context.new_page()
        watch(page, problems)
        page.goto(sup.url + "/#lab")
        page.wait_for_selector("body[data-ready='1']")
        assert page.title() == "Lab · mlxd" and page.inner_text("#no-jobs").startswith("No jobs yet")
        page.click("#view-lab summary:text('Merge two adapters')")
        page.wait_for_selector("#mg-a option[value=beta]", state="attached")
        page.select_option("#mg-a", "alpha")
        page.select_option("#mg-b", "beta")
        page.fill("#mg-scale-b", "0.5")
        page.fill("#mg-name", "both")
        page.click("#mg-form button[type=submit]")
        card = page.locator(".job[data-state=succeeded]")
        card.wait_for()
        assert card.locator("h3").inner_text() == "Merge: alpha + beta → both"
        assert card.locator(".result").inner_text() == "Made adapter both"
        # The new job is shown in detail, followed over its stream to the end.
        page.wait_for_selector("#job-detail-state.state-succeeded")
        assert page.inner_text("#job-detail-result").startswith("Made adapter both at ")
        job = sup.client.get("/lab/jobs").json()["data"][0]
        assert job["state"] == "succeeded" and job["request"]["scales"] == [1, 0.5]
        # The same name again: the server's 400, beside the form.
        page.click("#mg-form button[type=submit]")
        error = page.locator("#mg-form .form-error")
        error.wait_for()
        assert "exists already" in error.inner_text() and page.locator("#mg-name[aria-invalid=true]").count() == 1
        # Widths to share out go as a list: the server reads the lowest and highest of them.
        page.click("#view-lab summary:text('Quantize a model')")
        page.wait_for_selector("#qz-model option[value=tiny]", state="attached")
        page.fill("#qz-bpw", "15")
        page.fill("#qz-widths", "3, 4")
        page.click("#qz-form button[type=submit]")
        error = page.locator("#qz-form .form-error")
        error.wait_for()
        assert "out of reach" in error.inner_text() and "at 3 bits" in error.inner_text() \
            and "at 4 bits" in error.inner_text(), error.inner_text()
        # A learning rate is DWQ's: with GPTQ it is refused, and its field marked.
        page.fill("#qz-bpw", "")
        page.fill("#qz-widths", "")
        page.select_option("#qz-method", "gptq")
        page.fill("#qz-lr", "0.00001")
        page.click("#qz-form button[type=submit]")
        page.wait_for_selector("#qz-lr[aria-invalid=true]")
        assert "is for DWQ" in page.inner_text("#qz-form .form-error")
        for summary in page.locator("#view-lab summary").all():
            summary.click()  # every form open: none may widen a phone's screen
        assert page.evaluate(OVERFLOW) == [0, 0]
    finally:
        context.close()
    # The failures expected: the taken name's and the target's 400s (each answer, and the browser's console line).
    expected = [p for p in problems if "400: POST" in p or ("status of 400" in p and p.startswith("console:"))]
    assert [p for p in problems if p not in expected] == []


def test_the_chat_picker_offers_each_adapter_of_a_model(sup: SupervisorProcess, browser: Browser) -> None:
    context = browser.new_context()
    context.set_default_timeout(30_000)
    problems: list[str] = []
    try:
        page = context.new_page()
        watch(page, problems)
        page.goto(sup.url + "/#chat")
        page.wait_for_selector("body[data-ready='1']")
        group = page.locator("#chat-model optgroup[label='Adapters of tiny']")
        options = group.locator("option").evaluate_all("(os) => os.map((o) => o.value)")
        assert {"tiny:alpha", "tiny:beta"} <= set(options), options
        page.select_option("#chat-model", "tiny:alpha")
        page.fill("#chat-temperature", "0")
        page.fill("#chat-max-tokens", "2")
        page.fill("#chat-prompt", "Hello")
        page.press("#chat-prompt", "Enter")
        page.wait_for_selector(".message.assistant[data-done=done]", timeout=60_000)
        assert page.inner_text(".message.assistant .role") == "tiny:alpha"
    finally:
        context.close()
    assert problems == []
