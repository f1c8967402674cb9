"""The web page at `/` (dashboard and chat) in a real headless Chromium against a real supervisor.

Browser tests skip where Debian's Chromium is missing (`apt-get install chromium`); the
tests of the static files themselves need no browser.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, Playwright, expect, sync_playwright

from mlxd.protocol.stats import PHASE_NAMES
from tests.support import SupervisorProcess, model_with_template, serving, wait_for

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
USER_KEY, ADMIN_KEY = "user-sekret", "admin-sekret"
PHONE = {"width": 390, "height": 844}
# The phase names the page shows while a model loads: the protocol's, capitalised.
PHASES = tuple(name[0].upper() + name[1:] for name in PHASE_NAMES.values())
# SmolLM2 with a generation prompt that always opens a think block (the page sends no
# chat_template_kwargs): the engine returns the whole reply as `reasoning_content`. The engine
# takes <think> as a marker only from a template that names both ends, hence the comment.
ALWAYS_THINKING = (
    "{# a reply's reasoning ends at </think> #}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
FAKE_ENGINE = {"MLXD_ENGINE_MODULE": "tests.fake_engine", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
# Horizontal overflow of the document and of main, the page's scroller.
OVERFLOW = """() => [document.documentElement, document.getElementById('main')]
  .map((e) => e.scrollWidth - e.clientWidth)"""
# The boxes (viewport coordinates) of the chat, its composer and the status line, and the viewport's height.
BOXES = """() => ({height: innerHeight, ...Object.fromEntries(['view-chat', 'chat-form', 'status'].map((id) => {
  const r = document.getElementById(id).getBoundingClientRect();
  return [id, {top: r.top, bottom: r.bottom, height: r.height}];
}))})"""
# Records every length the answer's text has on screen, so a test can tell that it grew.
WATCH_ANSWER = """() => {
  window.lengths = [];
  new MutationObserver(() => {
    const content = document.querySelector('.message.assistant .content');
    if (content) window.lengths.push(content.textContent.length);
  }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
}"""
EVIL = [
    "<script>window.pwned = 1</script>",
    "<img src=x onerror=\"window.pwned = 2\">",
    "[click](javascript:window.pwned=3)",
    '[x](https://example.com/"onmouseover="window.pwned=4)',
    "```html\n<img src=x onerror=window.pwned=5>\n```",
    "`<svg onload=window.pwned=6>`",
    "**<iframe src=javascript:window.pwned=7>**",
    "- <a href=javascript:1>item</a>\n  <b onclick=x>y</b>",
]


class Watched:
    """A page whose console errors, failed requests and HTTP errors are collected."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.problems: list[str] = []
        page.on("console", lambda m: m.type in ("error", "warning") and self.problems.append(f"console: {m.text}"))
        page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        page.on("requestfailed", lambda r: self.problems.append(f"failed: {r.url} {r.failure}"))
        page.on("response", lambda r: r.status >= 400 and self.problems.append(f"HTTP {r.status}: {r.url}"))

    def open(self, url: str) -> Page:
        self.page.goto(url)
        self.page.wait_for_selector("body[data-ready='1']")
        return self.page


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    if not CHROMIUM.exists():
        pytest.skip("needs Debian's Chromium at /usr/bin/chromium (apt-get install chromium)")
    with sync_playwright() as pw:
        yield pw


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    # `make test` preloads OpenBLAS for MLX; in Chromium's GPU process it is fatal.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, env=env)
    yield browser
    browser.close()


@pytest.fixture(scope="module")
def sup(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    with serving(tiny_model, "tiny", tmp_path_factory.mktemp("web")) as proc:
        yield proc


@pytest.fixture
def watched(browser: Browser) -> Iterator[Watched]:
    context = browser.new_context()
    context.set_default_timeout(30_000)
    yield Watched(context.new_page())
    context.close()


def ask(page: Page, text: str, max_tokens: int) -> None:
    """Send `text` from the chat view, greedy (the tiny model then never stops early)."""
    page.fill("#chat-temperature", "0")
    page.fill("#chat-max-tokens", str(max_tokens))
    page.fill("#chat-prompt", text)
    page.press("#chat-prompt", "Enter")


def until(page: Page, js: str, timeout: float = 30) -> None:
    """Wait until `js` (an expression) holds in the page; polled from here, since the page's
    CSP forbids the eval that Playwright's wait_for_function uses."""
    assert wait_for(lambda: page.evaluate(js), timeout), js


def wait_answer(page: Page, sup: SupervisorProcess, done: str, timeout_ms: float = 30_000) -> None:
    """Wait for the last answer to end as `done`; on a timeout, say what the page and the
    supervisor saw (a long answer that never ended failed once in a full parallel run)."""
    try:
        page.wait_for_selector(f".message.assistant[data-done={done}]", timeout=timeout_ms)
    except Exception as exc:
        state = page.evaluate("""() => { const a = [...document.querySelectorAll('.message.assistant')].pop();
            return a ? {done: a.dataset.done || null, chars: a.querySelector('.content')?.textContent.length,
                        stats: a.querySelector('.stats')?.textContent} : null; }""")
        log = "\n".join(sup.log().splitlines()[-25:])
        raise AssertionError(f"no answer ended {done!r}: {exc}\nthe page's last answer: {state}\n"
                             f"the supervisor's log:\n{log}") from None


def answer_text(page: Page) -> str:
    return page.inner_text(".message.assistant >> nth=-1 >> .content")


def assert_composer_clear_of_status(page: Page) -> None:
    """After an answer longer than the screen, the whole composer is on screen and the status
    line covers none of it (a fixed status line once hid the Send row)."""
    boxes = page.evaluate(BOXES)
    chat, composer, status = boxes["view-chat"], boxes["chat-form"], boxes["status"]
    assert chat["height"] > boxes["height"], boxes  # the page had to scroll
    assert status["height"] > 0 and page.inner_text("#status") == "Answer finished."
    assert composer["bottom"] <= status["top"] or composer["top"] >= status["bottom"], boxes  # no overlap
    assert composer["top"] >= 0 and composer["bottom"] <= boxes["height"], boxes  # all of it on screen


def test_the_page_and_its_files_are_served_with_a_strict_policy(sup: SupervisorProcess) -> None:
    page = sup.client.get("/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self';" in csp and "unsafe" not in csp
    assert page.headers["x-frame-options"] == "DENY" and page.headers["cache-control"] == "no-cache"
    script = sup.client.get("/ui/app.js")
    assert script.headers["content-type"] == "text/javascript; charset=utf-8"
    assert script.headers["content-encoding"] == "gzip"  # httpx asked for it, and unpacked it
    plain = sup.client.get("/ui/app.js", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers and plain.content == script.content
    assert plain.headers["etag"] != script.headers["etag"]
    again = sup.client.get("/ui/app.js", headers={"If-None-Match": script.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    for bad in ("/ui/nothing.js", "/ui/..%2f__init__.py", "/ui/__init__.py", "/ui/index.html"):
        missing = sup.client.get(bad)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found", bad


def test_the_page_installs_as_an_app_and_opens_while_mlxd_is_down(sup: SupervisorProcess, watched: Watched) -> None:
    manifest = sup.client.get("/ui/manifest.webmanifest")
    assert manifest.status_code == 200 and manifest.headers["content-type"] == "application/manifest+json"
    app = manifest.json()
    assert app["display"] == "standalone" and app["start_url"].startswith("/") and app["scope"] == "/"
    assert all(sup.client.get(icon["src"]).status_code == 200 for icon in app["icons"])
    page = watched.open(sup.url + "/")
    assert page.evaluate("async () => (await navigator.serviceWorker.ready).scope") == sup.url + "/"
    until(page, "navigator.serviceWorker.controller !== null")
    page.reload()  # now under the worker: the shell's files pass through it
    page.wait_for_selector("body[data-ready='1']")
    page.evaluate("() => Promise.all(['/health', '/v1/models', '/admin/engines'].map((u) => fetch(u)))")
    cached = page.evaluate("""async () => (await (await caches.open('mlxd-shell-1')).keys())
        .map((r) => new URL(r.url).pathname)""")
    assert "/" in cached and "/ui/app.js" in cached and "/ui/app.css" in cached, cached
    assert all(path == "/" or path.startswith("/ui/") for path in cached), cached  # never API traffic
    assert watched.problems == []
    page.context.set_offline(True)
    page.reload()  # mlxd unreachable: the shell still opens, from the worker's copy
    page.wait_for_selector("nav a[data-view=chat]")
    assert page.title().endswith("mlxd")
    page.context.set_offline(False)


def test_the_dashboard_loads_with_no_errors(sup: SupervisorProcess, watched: Watched) -> None:
    page = watched.open(sup.url + "/")
    page.wait_for_selector("[data-model=tiny] .badge")
    assert page.title() == "Dashboard · mlxd"
    assert page.locator("#budget-text").inner_text().endswith("budget")
    assert page.locator("#chart-tps").get_attribute("aria-label", timeout=1000)
    assert watched.problems == []


def test_a_chat_answer_streams_in(sup: SupervisorProcess, watched: Watched) -> None:
    page = watched.open(sup.url + "/#chat")
    page.evaluate(WATCH_ANSWER)
    ask(page, "Hello", 1500)
    page.wait_for_selector(".message.assistant[data-done=done]", timeout=120_000)
    lengths = page.evaluate("window.lengths")  # not monotonic: "**bo" shows its stars until "**bold**" closes
    assert len(set(lengths)) >= 5 and lengths[0] < lengths[-1]
    assert re.fullmatch(r"1500 tokens · [\d.]+ tokens/s · first token after \d+ ms", page.inner_text(".stats"))
    assert page.locator("#chat-send").is_enabled() and page.locator("#chat-stop").is_disabled()
    assert_composer_clear_of_status(page)
    assert watched.problems == []


@pytest.fixture(scope="module")
def smol_sup(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    """SmolLM2 writes about 13 tokens a second here: a long answer is still being written when
    Stop is pressed, however slowly a loaded machine drives the browser (the tiny model wrote
    3000 tokens in 5 s, and a Stop once came after the end)."""
    with serving(smollm2, "smol", tmp_path_factory.mktemp("web-smol")) as proc:
        yield proc


def test_stop_keeps_the_partial_answer_and_the_chat_goes_on(smol_sup: SupervisorProcess, watched: Watched) -> None:
    sup = smol_sup
    page = watched.open(sup.url + "/#chat")
    ask(page, "Write a long story about a lighthouse keeper and the storm that changed her life.", 3000)
    until(page, "document.querySelector('.message.assistant .content').textContent.length > 40")
    page.click("#chat-stop")
    wait_answer(page, sup, "stopped")
    partial = answer_text(page)
    assert len(partial) > 40 and page.inner_text(".stats").startswith("Stopped · ~")
    # The engine stops generating too: nothing stays in flight.
    assert wait_for(lambda: sup.client.get("/admin/engines").json()["data"][0]["in_flight"] == 0, 30)
    assert page.locator("#chat-send").is_enabled() and page.locator("#chat-stop").is_disabled()
    ask(page, "Again", 5)
    page.wait_for_selector(".message.assistant >> nth=1 >> xpath=self::*[@data-done='done']")
    assert answer_text(page) and page.inner_text(".message.assistant >> nth=0 >> .content") == partial
    # The stream the Stop cut is the only request that did not finish.
    assert [p for p in watched.problems if "/v1/chat/completions" not in p] == []


def test_the_dashboard_loads_pins_and_unloads_a_model(sup: SupervisorProcess, watched: Watched) -> None:
    sup.client.post("/admin/unload", json={"model": "tiny", "force": True})
    page = watched.open(sup.url + "/")
    card = page.locator("[data-model=tiny]")
    page.wait_for_selector("[data-model=tiny][data-state=stopped]")
    card.locator("button[data-act=load]").click()
    page.wait_for_selector("[data-model=tiny][data-state=ready]", timeout=60_000)
    until(page, "document.getElementById('status').textContent.startsWith('tiny is ready')")
    card.locator("button[data-act=pin]").click()
    until(page, "document.getElementById('status').textContent === 'tiny is loaded and pinned.'")
    page.wait_for_selector("[data-model=tiny] .tag:not([hidden])")
    assert sup.client.get("/admin/engines").json()["data"][0]["pinned"] is True
    card.locator("button[data-act=unload]").click()  # asked first; Cancel keeps it
    page.locator("#confirm-dialog button[value=no]").click()
    assert sup.client.get("/admin/engines").json()["data"][0]["state"] == "ready"
    card.locator("button[data-act=unload]").click()
    assert "pinned" in page.inner_text("#confirm-dialog .question")
    page.locator("#confirm-dialog button[value=yes]").click()
    page.wait_for_selector("[data-model=tiny][data-state=stopped]")
    assert page.inner_text("#status") == "tiny is unloaded."
    assert watched.problems == []


def test_a_refused_action_shows_the_servers_message(sup: SupervisorProcess, watched: Watched) -> None:
    sup.client.post("/admin/load", json={"model": "tiny"})
    lease = sup.client.post("/admin/leases", json={"model": "tiny", "holder": "test"}).json()
    try:
        page = watched.open(sup.url + "/")
        page.wait_for_selector("[data-model=tiny][data-state=ready]")
        page.locator("[data-model=tiny] button[data-act=unload]").click()
        page.locator("#confirm-dialog button[value=yes]").click()
        page.wait_for_selector("#status[data-kind=error]")
        assert page.inner_text("#status") == f"Unloading tiny failed: Model tiny is leased ({lease['id']}); end the lease first."
    finally:
        sup.client.delete(f"/admin/leases/{lease['id']}")
    assert [p for p in watched.problems if "409" not in p] == []


# In the page: api() on /v1/models, whose first fetch saves `key` while it is out and answers 401
# (the page's other calls pass through).
RACED_401 = """async (key) => {
  const { api } = await import("/ui/api.js");
  const realFetch = window.fetch;
  const sent = [];
  window.fetch = async (path, init) => {
    if (path !== "/v1/models?raced") return realFetch(path, init);  // the dashboard's own polls
    sent.push(init.headers.Authorization || "");
    if (sent.length > 1) return realFetch(path, init);
    localStorage.setItem("mlxd.apiKey", key);
    return new Response('{"error": {"message": "Missing or invalid API key"}}', { status: 401 });
  };
  const dialog = document.getElementById("key-dialog");
  const late = new Promise((resolve) => setTimeout(() => resolve("no answer in 10 s"), 10000));
  try {
    const resp = await Promise.race([api("/v1/models?raced"), late]);
    return { status: resp.status ?? resp, sent, open: dialog.open };
  } finally {
    window.fetch = realFetch;
  }
}"""


def test_with_keys_the_page_asks_for_one_and_keeps_it(tiny_model: Path, tmp_path: Path, watched: Watched) -> None:
    config = f'[server]\napi_keys = ["{USER_KEY}"]\nadmin_keys = ["{ADMIN_KEY}"]\n\n[models.tiny]\npath = "{tiny_model}"\n'
    keyed = SupervisorProcess(config, tmp_path / "data").wait_up()
    try:
        page = watched.page
        page.goto(keyed.url + "/")
        page.wait_for_selector("#key-dialog[open]")
        # The dashboard's polls are refused together; the question says the strongest need,
        # whichever refusal came first (on a loaded machine /v1/models's did).
        expect(page.locator("#key-dialog .reason")).to_contain_text("admin key")
        page.fill("#key-input", ADMIN_KEY)
        page.press("#key-input", "Enter")
        page.wait_for_selector("[data-model=tiny] .badge")
        page.reload()
        page.wait_for_selector("body[data-ready='1']")
        assert page.locator("#key-dialog[open]").count() == 0 and page.locator("[data-model=tiny]").count() == 1
        assert page.evaluate("localStorage.getItem('mlxd.apiKey')") == ADMIN_KEY
        page.click("#key-button")  # "Forget key"
        assert page.evaluate("localStorage.getItem('mlxd.apiKey')") is None
        assert page.inner_text("#key-button") == "Enter key"
        # A call that was out while a key was saved (a dashboard poll as the dialog closed) gets
        # its 401 after the fact: it goes again with the key instead of asking again. Before,
        # it opened a second dialog, and the poll waiting on it stopped the dashboard's polling.
        raced = page.evaluate(RACED_401, USER_KEY)
        assert raced == {"status": 200, "sent": ["", f"Bearer {USER_KEY}"], "open": False}, raced
    finally:
        keyed.stop()
    # Only the first, keyless calls were refused.
    assert watched.problems and all("401" in p for p in watched.problems)


def test_a_wrong_key_shows_the_servers_error(tiny_model: Path, tmp_path: Path, watched: Watched) -> None:
    config = f'[server]\napi_keys = ["{USER_KEY}"]\n\n[models.tiny]\npath = "{tiny_model}"\n'
    keyed = SupervisorProcess(config, tmp_path / "data").wait_up()
    try:
        page = watched.page
        page.goto(keyed.url + "/#chat")
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#key-input", "wrong")
        page.click("#key-dialog button[value=save]")
        page.wait_for_selector("#status[data-kind=error]")
        assert "Missing or invalid API key" in page.inner_text("#status")
    finally:
        keyed.stop()


def test_a_phone_screen_has_no_horizontal_scroll(sup: SupervisorProcess, browser: Browser) -> None:
    context = browser.new_context(viewport=PHONE, device_scale_factor=2, is_mobile=True, has_touch=True)
    try:
        page = Watched(context.new_page()).open(sup.url + "/")
        page.wait_for_selector("[data-model=tiny] .badge")
        assert page.evaluate(OVERFLOW) == [0, 0]
        # The header keeps one line: the key button shrinks to an icon that keeps its name.
        header = [page.locator(s).bounding_box() for s in (".top", ".top nav", "#key-button")]
        assert all(box is not None for box in header)
        top, nav, key = (box for box in header if box is not None)
        assert top["height"] < 64 and key["y"] < nav["y"] + nav["height"] and nav["y"] < key["y"] + key["height"]
        assert page.get_by_role("button", name="Enter key").is_visible()
        page.goto(sup.url + "/#chat")
        # body[data-ready] is the dashboard's already (one mark a page load): wait for the chat's
        # models, listed once its form is wired (an Enter before that did nothing, once in a run)
        page.wait_for_selector("#chat-model option[value=tiny]", state="attached")
        ask(page, "Hello", 400)  # longer than the screen
        wait_answer(page, sup, "done", 60_000)
        assert_composer_clear_of_status(page)
        page.evaluate("""async () => {
          const {renderMarkdown} = await import('/ui/markdown.js');
          const li = document.createElement('li');
          li.className = 'message assistant';
          li.innerHTML = '<div class="content">' + renderMarkdown('x'.repeat(400) + '\\n```\\n' + 'y'.repeat(400) + '\\n```') + '</div>';
          document.getElementById('messages').append(li);
        }""")
        assert page.evaluate(OVERFLOW) == [0, 0]
    finally:
        context.close()


def test_model_output_is_shown_as_text(sup: SupervisorProcess, watched: Watched) -> None:
    page = watched.open(sup.url + "/#chat")
    result = page.evaluate("""async (evil) => {
      const {renderMarkdown} = await import('/ui/markdown.js');
      const box = document.createElement('div');
      document.body.append(box);
      box.innerHTML = evil.map(renderMarkdown).join('');
      await new Promise((r) => setTimeout(r, 200));  // an onerror would have fired by now
      const attrs = [...box.querySelectorAll('*')].flatMap((e) => [...e.attributes].map((a) => a.name));
      return {tags: [...new Set([...box.querySelectorAll('*')].map((e) => e.tagName.toLowerCase()))].sort(),
              attrs: [...new Set(attrs)].sort(), hrefs: [...box.querySelectorAll('a')].map((a) => a.href),
              text: box.textContent, pwned: window.pwned ?? null};
    }""", EVIL)
    assert result["pwned"] is None
    assert set(result["tags"]) <= {"p", "div", "button", "pre", "code", "span", "strong", "ul", "li", "br", "a"}
    assert set(result["attrs"]) <= {"class", "type", "href", "target", "rel"}
    assert result["hrefs"] == ["https://example.com/%22onmouseover=%22window.pwned=4"]
    for shown in ("<script>window.pwned = 1</script>", '<img src=x onerror="window.pwned = 2">',
                  "[click](javascript:window.pwned=3)", "<img src=x onerror=window.pwned=5>", "<svg onload=window.pwned=6>"):
        assert shown in result["text"]


def test_markdown_renders_the_usual_forms(sup: SupervisorProcess, watched: Watched) -> None:
    page = watched.open(sup.url + "/#chat")
    html = page.evaluate("""async () => {
      const {renderMarkdown} = await import('/ui/markdown.js');
      return renderMarkdown('# Title\\nSome **bold**, *it*, `code` and [a link](https://example.com/a_b_c).\\n\\n'
        + '1. one\\n2. two\\n   - nested\\n\\n> quoted\\n\\n```python\\ndef f(x):  # note\\n    return "s" + 1\\n```');
    }""")
    assert "<h3>Title</h3>" in html
    assert "<strong>bold</strong>, <em>it</em>, <code>code</code>" in html
    assert '<a href="https://example.com/a_b_c" target="_blank" rel="noopener noreferrer">a link</a>' in html
    assert "<ol><li>one</li><li>two<ul><li>nested</li></ul></li></ol>" in html
    assert "<blockquote><p>quoted</p></blockquote>" in html
    assert '<span class="tok-kw">def</span> f(x):  <span class="tok-com"># note</span>' in html
    assert '<span class="tok-str">&quot;s&quot;</span> + <span class="tok-num">1</span>' in html
    assert watched.problems == []


def test_a_hidden_tab_stops_polling(sup: SupervisorProcess, watched: Watched) -> None:
    page = watched.open(sup.url + "/")
    polls: list[str] = []
    page.on("request", lambda r: "/admin/engines" in r.url and polls.append(r.url))
    visibility = """(hidden) => {
      Object.defineProperty(document, 'hidden', {configurable: true, get: () => hidden});
      document.dispatchEvent(new Event('visibilitychange'));
    }"""
    page.evaluate(visibility, True)
    page.wait_for_timeout(5000)  # two and a half polling periods: an absence takes a window to see
    assert polls == []
    with page.expect_request(lambda r: "/admin/engines" in r.url, timeout=10_000):
        page.evaluate(visibility, False)  # shown again: refreshed at once
    assert watched.problems == []


def test_a_cold_model_shows_its_load_while_the_answer_waits(sup: SupervisorProcess, watched: Watched) -> None:
    sup.client.post("/admin/unload", json={"model": "tiny", "force": True})
    page = watched.open(sup.url + "/#chat")
    page.evaluate("""() => {
      window.waits = [];
      new MutationObserver(() => {
        const text = document.querySelector('.message.assistant .waiting .load-text');
        if (text) window.waits.push(text.textContent);
      }).observe(document.getElementById('messages'), {childList: true, subtree: true});
    }""")
    ask(page, "Hello", 5)
    page.wait_for_selector(".message.assistant[data-done=done]", timeout=60_000)
    waits = page.evaluate("window.waits")
    # The supervisor reports a phase from the spawn on; the tiny model may skip any of the others.
    assert any(w.startswith(PHASES) for w in waits), waits
    generic = ("Waiting for the model…", "Starting…", "Waiting for the first token…")  # stopped, no load yet, ready
    assert all(w.startswith(PHASES) or w in generic for w in waits), waits
    assert page.locator(".message.assistant .waiting").is_hidden()
    assert watched.problems == []


def test_a_server_error_is_shown_in_the_answer(sup: SupervisorProcess, watched: Watched) -> None:
    page = watched.open(sup.url + "/#chat")
    # A model that went away after the list was read: the server's 404 reaches the page.
    page.evaluate("""() => {
      const option = new Option('gone', 'gone');
      document.getElementById('chat-model').append(option);
      option.selected = true;
    }""")
    ask(page, "Hello", 5)
    page.wait_for_selector(".message.assistant[data-done=error]")
    error = page.inner_text(".message.assistant .error")
    assert error.startswith("Error: ") and "gone" in error and "tiny" in error  # the message lists what exists
    assert page.locator("#chat-send").is_enabled()
    assert [p for p in watched.problems if "404" not in p] == []


def test_reasoning_streams_into_a_folded_block(smollm2: Path, tmp_path: Path, watched: Watched) -> None:
    model = model_with_template(smollm2, tmp_path / "smol-think", ALWAYS_THINKING)
    thinking = SupervisorProcess(f'[models.smol-think]\npath = "{model}"\n', tmp_path / "data").wait_up()
    try:
        page = watched.open(thinking.url + "/#chat")
        page.evaluate("""() => {
          window.folds = [];  // [length of the reasoning shown, whether its block was open] at each change
          new MutationObserver(() => {
            const fold = document.querySelector('.message.assistant details.reasoning');
            if (fold && !fold.hidden) window.folds.push([fold.querySelector('.reasoning-text').textContent.length, fold.open]);
          }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
        }""")
        ask(page, "What is the capital of France?", 24)
        page.wait_for_selector(".message.assistant[data-done=done]", timeout=120_000)
        folds = page.evaluate("window.folds")
        assert len({n for n, _ in folds}) >= 2 and not any(is_open for _, is_open in folds), folds  # grew, folded
        fold, text = page.locator(".message.assistant details.reasoning"), page.locator(".message.assistant .reasoning-text")
        assert fold.is_visible() and fold.get_attribute("open") is None and text.is_hidden()
        assert (text.text_content() or "").strip() and answer_text(page) == ""  # SmolLM2 never closes the block
        fold.locator("summary").click()
        assert fold.get_attribute("open") == "" and text.is_visible() and text.inner_text().strip()
        assert "<think>" not in text.inner_text()
    finally:
        thinking.stop()
    assert watched.problems == []


def test_a_tool_call_is_shown_with_its_arguments(tmp_path: Path, watched: Watched) -> None:
    # The page sends no `tools`, so a real model calls none: the fake engine streams one on cue.
    model = tmp_path / "fake-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    env = {**FAKE_ENGINE, "MLXD_FAKE_MODE": "tool_calls"}
    fake = SupervisorProcess(f'[models.fake]\npath = "{model}"\n', tmp_path / "data", env=env).wait_up()
    try:
        page = watched.open(fake.url + "/#chat")
        ask(page, "The weather in Paris?", 5)
        page.wait_for_selector(".message.assistant[data-done=done]")
        call = page.locator(".message.assistant .tool-call")
        assert call.count() == 1 and call.locator("code").inner_text() == "get_weather"
        assert json.loads(call.locator("pre").inner_text()) == {"city": "Paris"}  # its pieces joined
        assert answer_text(page) == ""
    finally:
        fake.stop()
    assert watched.problems == []


def test_a_load_with_a_known_total_draws_a_bar(sup: SupervisorProcess, watched: Watched) -> None:
    # The tiny model loads too fast to catch a bar: the page's own module draws these loads.
    loads = {"known": {"phase": "weights", "done": 50, "total": 200, "unit": "bytes", "elapsed_s": 1.2},
             "unknown": {"phase": "warmup", "done": 0, "total": None, "unit": None, "elapsed_s": 3.4}}
    page = watched.open(sup.url + "/#chat")
    page.evaluate("""async (loads) => {
      const {makeLoadView} = await import('/ui/progress.js');
      for (const [id, load] of Object.entries(loads)) {
        const view = makeLoadView(load, 'starting');
        view.id = id;
        document.getElementById('messages').append(view);
      }
    }""", loads)
    bar = page.get_by_role("progressbar", name="Reading weights")
    assert bar.count() == 1 and bar.evaluate("(p) => [p.value, p.max, p.position]") == [50, 200, 0.25]
    assert page.inner_text("#known .load-text").startswith("Reading weights: 50 B of 200 B (25%), 1.")
    assert page.locator("#unknown progress").count() == 0 and page.locator("#unknown .spinner").is_visible()
    assert page.inner_text("#unknown .load-text").startswith("Warming up GPU kernels, 3.")
    assert watched.problems == []


# Puts a PNG (base64 `b64`) on the page as a File and hands it to `target` in a `kind` event
# (a drop on the composer, a paste into the prompt), as a person dragging or pasting one would.
HAND_OVER = """([b64, kind]) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const data = new DataTransfer();
  data.items.add(new File([bytes], kind + '.png', {type: 'image/png'}));
  const target = document.getElementById(kind === 'drop' ? 'chat-form' : 'chat-prompt');
  const event = kind === 'drop' ? new DragEvent('drop', {dataTransfer: data, bubbles: true, cancelable: true})
                                : new ClipboardEvent('paste', {clipboardData: data, bubbles: true, cancelable: true});
  target.dispatchEvent(event);
}"""


def test_images_attached_by_picker_drop_and_paste_go_with_the_message(
    vlms: dict[str, Path], tmp_path: Path, watched: Watched,
) -> None:
    import base64
    import io

    from PIL import Image

    def png(color: tuple[int, int, int]) -> bytes:
        out = io.BytesIO()
        Image.new("RGB", (112, 112), color).save(out, "PNG")  # 16 image tokens in the tiny Qwen2-VL
        return out.getvalue()

    picked = tmp_path / "picked.png"
    picked.write_bytes(png((200, 30, 30)))
    with serving(vlms["qwen2_vl"], "vlm", tmp_path / "data") as sup:
        page = watched.open(sup.url + "/#chat")
        assert page.inner_text("#chat-model option") == "vlm (images)"
        page.set_input_files("#chat-file", str(picked))
        page.evaluate(HAND_OVER, [base64.b64encode(png((30, 200, 30))).decode(), "drop"])
        page.evaluate(HAND_OVER, [base64.b64encode(png((30, 30, 200))).decode(), "paste"])
        until(page, "document.querySelectorAll('#chat-attachments img').length === 3")
        page.click("#chat-attachments li:nth-child(2) button")  # the dropped one goes again
        assert page.locator("#chat-attachments img").count() == 2
        ask(page, "What colours are these?", 4)
        wait_answer(page, sup, "done")
        sent = page.locator(".message.user >> nth=-1 >> .images img")
        assert sent.count() == 2 and sent.nth(0).get_attribute("alt") == "picked.png"
        assert page.locator("#chat-attachments").is_hidden()
        assert re.fullmatch(r"4 tokens · .*", page.inner_text(".message.assistant >> nth=-1 >> .stats"))
        prompt = sup.engine_stats("vlm")["tokens"]["prompt"]
        assert prompt >= 2 * 16 + 10, prompt  # the two images' tokens went in with the text
        assert watched.problems == []


def test_the_curve_designer_draws_the_signal_and_samples_under_a_dragged_curve(sup: SupervisorProcess,
                                                                               watched: Watched) -> None:
    page = watched.open(sup.url + "/curves")  # the reference's address: a redirect to the view
    page.wait_for_selector("#curve-plot .handle")
    assert page.title() == "Curve designer · mlxd"
    page.wait_for_selector("#curve-model option[value=tiny]", state="attached")
    page.click("#curve-signal")
    until(page, "document.querySelectorAll('#curve-plot .signal').length > 3")
    assert page.inner_text("#curve-top")
    handle = page.locator("#curve-plot .handle").nth(0)  # the left end: drag it up (never above its neighbour)
    box = handle.bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] - 60, steps=5)
    page.mouse.up()
    points = json.loads(page.input_value("#curve-json"))["points"]
    assert points[0][1] > -30 and points[0][1] <= points[1][1]  # moved, and still rising
    page.fill("#curve-n", "2")
    page.fill("#curve-max", "6")
    page.fill("#curve-seed", "3")
    page.click("#curve-generate")
    until(page, "document.querySelectorAll('#curve-samples li').length === 2")
    assert page.inner_text("#curve-mode").startswith("curve, seed 3")
    page.click("#curve-default")
    until(page, "document.querySelector('#curve-mode').textContent.startsWith('default')")
    assert watched.problems == []
