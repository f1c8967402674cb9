"""The pool's default memory budget (supervisor/engines/footprint.py): a share of RAM, or on
CUDA of the smallest visible GPU's memory as nvidia-smi reports it (a CUDA engine's weights,
KV and prompt cache live on the card, not in RAM)."""

from __future__ import annotations

import stat
from pathlib import Path

import psutil
import pytest

from mlxd.supervisor.config import PoolConfig
from mlxd.supervisor.engines import footprint
from mlxd.supervisor.engines.footprint import default_budget_bytes, gpu_memory_bytes
from mlxd.supervisor.engines.pool import limits_from

MIB = 1024**2
CARDS = """0, GPU-11111111-aaaa-bbbb-cccc-000000000000, 81559
1, GPU-22222222-aaaa-bbbb-cccc-000000000000, 40960
2, GPU-33333333-aaaa-bbbb-cccc-000000000000, 143771
"""


@pytest.fixture
def smi(tmp_path: Path) -> Path:
    """An nvidia-smi that answers the query the supervisor makes, as the real one does."""
    path = tmp_path / "nvidia-smi"
    path.write_text("#!/bin/sh\n"
                    '[ "$1" = "--query-gpu=index,uuid,memory.total" ] && [ "$2" = "--format=csv,noheader,nounits" ] '
                    f"|| exit 9\ncat <<'END'\n{CARDS}END\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.mark.parametrize(("visible", "mib"), [
    (None, 40960),  # every card: the smallest
    ("0", 81559),
    ("2,0", 81559),
    ("GPU-33333333", 143771),  # a UUID's prefix, as CUDA takes it
    ("2,-1,1", 143771),  # CUDA stops at the first invalid entry
    ("7", None),  # no such card
    ("", None),  # none visible
])
def test_the_smallest_visible_card_sets_the_gpu_memory(smi: Path, visible: str | None, mib: int | None) -> None:
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    got = gpu_memory_bytes(environ, str(smi))
    assert got == (None if mib is None else mib * MIB)


def test_no_nvidia_smi_or_one_that_fails_reads_nothing(tmp_path: Path) -> None:
    assert gpu_memory_bytes({}, str(tmp_path / "absent")) is None
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    failing.chmod(0o755)
    assert gpu_memory_bytes({}, str(failing)) is None


def test_on_cuda_the_budget_is_the_gpus_memory_and_elsewhere_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    ram = psutil.virtual_memory().total
    monkeypatch.setattr(footprint, "gpu_memory_bytes", lambda: 80 * 1024**3)
    assert default_budget_bytes(None, "cuda") == 80 * 1024**3  # all of it: the engine keeps its headroom
    assert default_budget_bytes(0.5, "cuda") == 40 * 1024**3
    assert default_budget_bytes(None, "cpu") == int(ram * 0.75)
    assert default_budget_bytes(None, "metal") == int(ram * 0.75)
    assert default_budget_bytes(0.5, "cpu") == int(ram * 0.5)
    assert limits_from(PoolConfig(), "cuda").budget_bytes == 80 * 1024**3
    assert limits_from(PoolConfig(memory_budget_gb=12), "cuda").budget_bytes == 12 * 1024**3
    monkeypatch.setattr(footprint, "gpu_memory_bytes", lambda: None)  # a driver that does not answer
    assert default_budget_bytes(None, "cuda") == int(ram * 0.75)


def test_on_cuda_the_prompt_cache_is_booked_as_the_engine_sizes_it() -> None:
    """10% of RAM (512 MiB to 32 GiB) elsewhere; on CUDA at most 10% of the engine's memory,
    the rule engine/gpu/device_memory.py's prompt_cache_sized applies."""
    from mlxd.protocol.memory import default_prompt_cache_bytes
    from mlxd.supervisor.engines.pool import prompt_cache_bytes

    ram = default_prompt_cache_bytes(psutil.virtual_memory().total)
    card = 24 * 1024**3
    assert prompt_cache_bytes(PoolConfig(), "cpu", card) == ram
    assert prompt_cache_bytes(PoolConfig(), "cuda", card) == min(ram, default_prompt_cache_bytes(card))
    assert prompt_cache_bytes(PoolConfig(), "cuda", 2 * 1024**3) == 512 * MIB  # the floor
    assert prompt_cache_bytes(PoolConfig(prompt_cache_bytes=3 * MIB), "cuda", card) == 3 * MIB  # configured
