"""The web page at `/`: dashboard and chat, static files served from the `mlxd.web` package.

The page is plain HTML, CSS and JS modules (no build step, no CDN). Every file is sent with
`Cache-Control: no-cache` and an ETag: a revisit costs one 304 per file, and an upgraded
mlxd never leaves a browser running stale modules that import each other by name. Files are
gzipped once, when first asked for: the first load is ~22 KB instead of ~55 KB
(benchmarks/web_first_load.py), which a phone on Wi-Fi notices.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import re
from dataclasses import dataclass
from importlib import resources

from aiohttp import web

from mlxd.protocol.errors import APIError

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png", ".ico": "image/x-icon",
    ".webmanifest": "application/manifest+json",
}
# Same-origin only, no inline script or style, no eval: model output rendered by the page
# can never run code, even if the Markdown renderer had a hole.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
ASSET_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*\.(?:js|css|svg|png|ico|webmanifest)")


@dataclass(frozen=True)
class Asset:
    """One static file of the page, with its content type and ETag."""

    body: bytes
    content_type: str
    etag: str
    gzipped: bytes | None  # None where gzip would not make it smaller (the PNG screenshots)


@functools.cache
def load_asset(name: str) -> Asset | None:
    """The packaged file `name` (None if there is none); read once, kept for the process's life."""
    path = resources.files("mlxd.web").joinpath(name)
    if not path.is_file():
        return None
    body = path.read_bytes()
    suffix = name[name.rfind("."):]
    packed = gzip.compress(body, mtime=0)
    return Asset(body, CONTENT_TYPES[suffix], hashlib.sha256(body).hexdigest()[:20],
                 packed if len(packed) < len(body) else None)


def asset_response(request: web.Request, asset: Asset) -> web.Response:
    """200 with the file (gzipped when the browser takes it), or 304 when its copy is current."""
    use_gzip = asset.gzipped is not None and "gzip" in request.headers.get("Accept-Encoding", "")
    etag = f'"{asset.etag}-gz"' if use_gzip else f'"{asset.etag}"'  # one tag per encoding
    headers = {"Cache-Control": "no-cache", "ETag": etag, "Vary": "Accept-Encoding",
               "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
    if asset.content_type.startswith("text/html"):
        headers |= {"Content-Security-Policy": CSP, "X-Frame-Options": "DENY"}
    if request.headers.get("If-None-Match") == etag:
        return web.Response(status=304, headers=headers)
    headers["Content-Type"] = asset.content_type
    if use_gzip:
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=asset.gzipped if use_gzip else asset.body, headers=headers)


async def index(request: web.Request) -> web.Response:
    """GET /: the page (dashboard and chat, one document with hash routing)."""
    asset = load_asset("index.html")
    if asset is None:
        raise APIError(404, "The web page is not installed (mlxd.web has no index.html).", code="not_found")
    return asset_response(request, asset)


async def ui_file(request: web.Request) -> web.Response:
    """GET /ui/{name}: one of the page's scripts, styles or icons."""
    name = request.match_info["name"]
    asset = load_asset(name) if ASSET_NAME.fullmatch(name) else None
    if asset is None:
        raise APIError(404, f"No such file: /ui/{name[:100]}", code="not_found")
    return asset_response(request, asset)


async def service_worker(request: web.Request) -> web.Response:
    """GET /sw.js: the page's service worker, at the root so that its scope is the whole page."""
    asset = load_asset("sw.js")
    if asset is None:
        raise APIError(404, "The web page is not installed (mlxd.web has no sw.js).", code="not_found")
    return asset_response(request, asset)


def setup_web_routes(app: web.Application) -> None:
    """Wire `/`, `/sw.js` and `/ui/*` (the lead's auth middleware leaves them open: they hold no data)."""
    app.router.add_get("/", index)
    app.router.add_get("/sw.js", service_worker)
    app.router.add_get("/ui/{name}", ui_file)
