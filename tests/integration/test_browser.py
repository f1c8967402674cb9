"""A real browser (headless Chromium) against mlxd: what a web page can and cannot do to it.

Skipped where Chromium is not installed (Debian: `apt-get install chromium`); the same
checks run without a browser in test_hardening.py, header by header.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.support import HARDENED_CONFIG, SupervisorProcess, fake_supervisor, free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)")

ATTACK = """<!doctype html><html><body><pre id="out">running</pre><script>
const mlxd = "http://127.0.0.1:%(port)d";
const out = [];
async function attempt(name, url, init) {
  try {
    const resp = await fetch(url, init);
    let text = "";
    try { text = await resp.text(); } catch (e) {}
    out.push(name + " status=" + resp.status + " type=" + resp.type + " body=" + text.slice(0, 60));
  } catch (e) { out.push(name + " blocked"); }
}
(async () => {
  await attempt("unload", mlxd + "/admin/unload",
    {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body: '{"model": "fake"}'});
  await attempt("models", mlxd + "/v1/models", {});
  await attempt("chat", mlxd + "/v1/completions",
    {method: "POST", headers: {"Content-Type": "application/json"}, body: '{"model": "fake", "prompt": "x"}'});
  document.getElementById("out").textContent = out.join("\\n") + "\\ndone";
})();
</script></body></html>"""


class Page(BaseHTTPRequestHandler):
    """Serves the attacking page from another origin."""

    html = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(self.html)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def sup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    proc = fake_supervisor(tmp_path_factory.mktemp("browser"), config=HARDENED_CONFIG)
    try:
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def page_server(html: str) -> Iterator[int]:
    """An HTTP server on another port (another origin) serving `html`."""
    port = free_port()
    handler = type("P", (Page,), {"html": html.encode()})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        server.shutdown()
        server.server_close()


def dump_dom(url: str, *flags: str) -> str:
    assert CHROMIUM is not None
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=8000",
            "--dump-dom", *flags, url]
    # make test preloads OpenBLAS for MLX; in Chromium's GPU process it is fatal.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env).stdout


def test_a_page_on_another_origin_cannot_unload_or_read(sup: SupervisorProcess) -> None:
    assert sup.client.post("/admin/load", json={"model": "fake"}).status_code == 200
    with page_server(ATTACK % {"port": sup.port}) as port:
        dom = dump_dom(f"http://127.0.0.1:{port}/")
    assert "done" in dom, dom
    assert "unload status=0 type=opaque" in dom  # sent, as no-cors requests are; refused by mlxd
    assert "models blocked" in dom and "chat blocked" in dom  # no CORS for that origin
    engines = sup.client.get("/admin/engines").json()["data"]
    assert [e["state"] for e in engines] == ["ready"]
    assert sup.client.get("/v1/models").status_code == 200


def test_a_rebound_name_gets_403(sup: SupervisorProcess) -> None:
    dom = dump_dom(f"http://evil.example:{sup.port}/v1/models", "--host-resolver-rules=MAP evil.example 127.0.0.1")
    assert "forbidden_origin" in dom
    assert '"object"' not in dom  # no model list


def test_an_allowed_origin_reads_answers(sup: SupervisorProcess) -> None:
    # test_hardening's config allows http://localhost:* : a page there may use mlxd.
    with page_server(ATTACK % {"port": sup.port}) as port:
        dom = dump_dom(f"http://localhost:{port}/")
    assert "models status=200 type=cors" in dom, dom
    assert "chat status=200 type=cors" in dom, dom

