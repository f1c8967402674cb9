"""The adapters catalog (mlxd/supervisor/adapters.py): a request's miss rescans at most once a
second, while an admin route's `find` rescans on every miss (an adapter put in the dir a moment
ago is pushed or fused, not refused)."""

from __future__ import annotations

import json
from pathlib import Path

from mlxd.supervisor.adapters import AdapterCatalog


def make_adapter(path: Path) -> None:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"base_model": "smol", "lora_parameters": {"rank": 4}}))
    (path / "adapters.safetensors").write_bytes(b"\0" * 16)


def test_find_sees_an_adapter_made_a_moment_after_a_miss(tmp_path: Path) -> None:
    catalog = AdapterCatalog(tmp_path / "adapters", tmp_path / "models")
    assert catalog.get("fresh") is None  # a miss: rescanned, now rate-limited for a second
    make_adapter(tmp_path / "adapters" / "fresh")
    assert catalog.get("fresh") is None  # within the second: not rescanned
    found = catalog.find("fresh")
    assert found is not None and found.base_model == "smol"
    assert catalog.get("fresh") == found
