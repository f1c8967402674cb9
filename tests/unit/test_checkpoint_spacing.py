"""How far apart a row's generation checkpoints are (gpu/checkpoints.py `spacing`): `interval`
up to its first, then a sixteenth of its prompt, at least MIN_SPACING, at most `interval`; so a
continuation after a crash prefills a small share of what the prompt's cold prefill costs."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.cache.ssd_tier import SsdTier
from mlxd.engine.gpu.checkpoints import MIN_SPACING, Checkpoints


def row(prompt: int, generated: int, saved: int, base: Any = None, links: int = 0) -> Any:
    return SimpleNamespace(job=SimpleNamespace(prompt=[1] * prompt), generated=[2] * generated, saved=saved,
                           base=base, links=links, is_finished=False)


@pytest.fixture
def checkpoints(tmp_path: Path) -> Any:
    cache = PrefixCache(1 << 30, SsdTier(tmp_path, 1 << 30), threading.Event())
    yield Checkpoints(512, cache, None)  # type: ignore[arg-type]
    cache.close()


@pytest.mark.parametrize(("prompt", "spacing"), [(40, MIN_SPACING), (1_211, MIN_SPACING), (4_574, 285),
                                                 (20_000, 512)])
def test_after_the_first_checkpoint_the_spacing_follows_the_prompt(checkpoints: Any, prompt: int,
                                                                   spacing: int) -> None:
    assert checkpoints.spacing(row(prompt, 1, 0)) == 512  # none yet: `interval`
    assert checkpoints.spacing(row(prompt, 1, prompt, base=object())) == spacing
    # KV that makes no deltas (quantized, say): every checkpoint a whole file, `interval` apart
    assert checkpoints.spacing(row(prompt, 1, prompt, base=object(), links=-1)) == 512


def test_a_row_is_due_when_its_spacing_of_tokens_has_no_kv_on_ssd(checkpoints: Any) -> None:
    assert not checkpoints.due(row(300, 1, 0))  # 301 tokens, none on SSD: not yet `interval`
    assert checkpoints.due(row(600, 1, 0))  # its prompt, at its first token
    assert not checkpoints.due(row(1_211, 127, 1_211, base=object()))
    assert checkpoints.due(row(1_211, 128, 1_211, base=object()))
    assert not checkpoints.due(row(4_574, 284, 4_574, base=object()))
    assert checkpoints.due(row(4_574, 285, 4_574, base=object()))


def test_no_ssd_tier_no_checkpoints() -> None:
    assert Checkpoints(512, PrefixCache(1 << 30), None).interval == 0  # type: ignore[arg-type]
