"""An import into a data dir that does not exist yet makes it private (0700), as mlxd makes every dir."""

from __future__ import annotations

import stat
from pathlib import Path

from mlxd.engine.models import importer
from tests.gguf_files import tiny_llama_file


def test_an_import_makes_the_dirs_it_needs_0700_and_leaves_existing_ones(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    out = importer.import_gguf(tiny_llama_file(tmp_path), tmp_path / "data" / "models", "tiny", "float32")
    made = [tmp_path / "data", tmp_path / "data" / "models", out]
    assert [stat.S_IMODE(p.stat().st_mode) for p in [tmp_path, *made]] == [0o755, 0o700, 0o700, 0o700]
