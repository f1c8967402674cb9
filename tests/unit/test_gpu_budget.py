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
from tests.support import fake_weights

MIB = 1024**2
CARDS = """0, GPU-11111111-aaaa-bbbb-cccc-000000000000, 81559, [N/A]
1, GPU-22222222-aaaa-bbbb-cccc-000000000000, 40960, Disabled
2, GPU-33333333-aaaa-bbbb-cccc-000000000000, 143771, [N/A]
"""
QUERY = '[ "$1" = "--query-gpu=index,uuid,memory.total,mig.mode.current" ] && [ "$2" = "--format=csv,noheader,nounits" ]'


def fake_smi(tmp_path: Path, cards: str) -> Path:
    """An nvidia-smi that answers the query the supervisor makes, as the real one does."""
    path = tmp_path / "nvidia-smi"
    path.write_text(f"#!/bin/sh\n{QUERY} || exit 9\ncat <<'END'\n{cards}END\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def smi(tmp_path: Path) -> Path:
    return fake_smi(tmp_path, CARDS)


PCI = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


@pytest.mark.parametrize(("environ", "mib"), [
    ({}, 40960),  # every card: the smallest
    ({"CUDA_VISIBLE_DEVICES": "0", **PCI}, 81559),  # by index, in nvidia-smi's (PCI) order
    ({"CUDA_VISIBLE_DEVICES": "2,0", **PCI}, 81559),
    ({"CUDA_VISIBLE_DEVICES": "2,-1,1", **PCI}, 143771),  # CUDA stops at the first invalid entry
    ({"CUDA_VISIBLE_DEVICES": "0"}, 40960),  # CUDA's own order (fastest first) may name another card
    ({"CUDA_VISIBLE_DEVICES": "GPU-33333333"}, 143771),  # a UUID's prefix, as CUDA takes it
    ({"CUDA_VISIBLE_DEVICES": "GPU-33333333-aaaa-bbbb-cccc-000000000000,GPU-11111111"}, 81559),
    ({"CUDA_VISIBLE_DEVICES": "7", **PCI}, None),  # no such card
    ({"CUDA_VISIBLE_DEVICES": ""}, None),  # none visible
    ({"CUDA_VISIBLE_DEVICES": "GPU-99"}, None),
])
def test_the_smallest_visible_card_sets_the_gpu_memory(smi: Path, environ: dict[str, str], mib: int | None) -> None:
    got = gpu_memory_bytes(environ, str(smi))
    assert got == (None if mib is None else mib * MIB)


def test_a_card_split_by_mig_is_not_read_as_whole(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """CUDA sees a MIG slice, not the card: its memory is not the card's (the budget falls back)."""
    smi = fake_smi(tmp_path, CARDS.replace("Disabled", "Enabled"))
    assert gpu_memory_bytes({}, str(smi)) is None
    assert "split by MIG" in caplog.text and "memory_budget_gb" in caplog.text


def test_lines_that_are_not_a_cards_are_passed_over(tmp_path: Path) -> None:
    smi = fake_smi(tmp_path, "No devices were found\n" + CARDS.replace("0, GPU-1111", "[N/A], GPU-1111")
                   + "1, GPU-44444444-aaaa-bbbb-cccc-000000000000, [N/A], Disabled\n")
    assert gpu_memory_bytes({"CUDA_VISIBLE_DEVICES": "0,1", **PCI}, str(smi)) == 40960 * MIB
    assert gpu_memory_bytes({}, str(smi)) == 40960 * MIB


def test_no_nvidia_smi_or_one_that_fails_reads_nothing(tmp_path: Path) -> None:
    assert gpu_memory_bytes({}, str(tmp_path / "absent")) is None
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    failing.chmod(0o755)
    assert gpu_memory_bytes({}, str(failing)) is None


def test_on_cuda_the_budget_is_the_gpus_memory_and_elsewhere_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    ram = psutil.virtual_memory().total
    monkeypatch.setattr(footprint, "visible_gpu_memory_bytes", lambda: 80 * 1024**3)
    assert default_budget_bytes(None, "cuda") == 80 * 1024**3  # all of it: the engine keeps its headroom
    assert default_budget_bytes(0.5, "cuda") == 40 * 1024**3
    assert default_budget_bytes(None, "cpu") == int(ram * 0.75)
    assert default_budget_bytes(None, "metal") == int(ram * 0.75)
    assert default_budget_bytes(0.5, "cpu") == int(ram * 0.5)
    assert limits_from(PoolConfig(), "cuda").budget_bytes == 80 * 1024**3
    assert limits_from(PoolConfig(memory_budget_gb=12), "cuda").budget_bytes == 12 * 1024**3
    monkeypatch.setattr(footprint, "visible_gpu_memory_bytes", lambda: None)  # a driver that does not answer
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


@pytest.mark.parametrize(("device", "backend", "split"), [
    ("cuda", "nccl", True),  # NCCL ranks on this machine: a GPU each, the budget one GPU's
    ("cuda", "ring", False),  # ring ranks here share the one GPU: the whole engine
    ("cpu", "ring", False),  # ... and RAM
])
def test_a_group_on_this_machine_books_a_ranks_part_only_where_each_rank_has_a_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str, backend: str, split: bool) -> None:
    from mlxd.protocol.group import GroupSpec
    from mlxd.supervisor.engines import pool as pool_module
    from mlxd.supervisor.registry import ModelEntry

    monkeypatch.setattr(pool_module, "this_device", lambda: device)
    monkeypatch.setattr(footprint, "visible_gpu_memory_bytes", lambda: 80 * 1024**3)
    tensors = {"model.embed_tokens.weight": 1000, "lm_head.weight": 1000}
    tensors |= {f"model.layers.{i}.mlp.up_proj.weight": 4000 for i in range(4)}
    model = fake_weights(tmp_path / "m", tensors)
    pool = pool_module.Pool(tmp_path, config=PoolConfig(prompt_cache_bytes=0, batch=1))
    size = sum(tensors.values())
    alone = pool.memory_estimate(ModelEntry(id="m", path=model, source="config", size_bytes=size, batch=1))
    group = GroupSpec(ranks=2, backend=backend)  # type: ignore[arg-type]
    grouped = pool.memory_estimate(ModelEntry(id="m", path=model, source="config", size_bytes=size, batch=1,
                                              distributed=group))
    if split:
        assert grouped < alone and grouped >= 2000 + 8000  # the embeddings whole, half the layers
    else:
        assert grouped == alone


def test_the_memory_the_models_live_in_is_the_gpus_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `/library`'s machine and `mlxd models --fit` show the budget as a share of."""
    from mlxd.supervisor.engines.footprint import models_memory_bytes

    monkeypatch.setattr(footprint, "visible_gpu_memory_bytes", lambda: 80 * 1024**3)
    assert models_memory_bytes("cuda") == 80 * 1024**3
    assert models_memory_bytes("cpu") == models_memory_bytes("metal") == psutil.virtual_memory().total
    monkeypatch.setattr(footprint, "visible_gpu_memory_bytes", lambda: None)
    assert models_memory_bytes("cuda") == psutil.virtual_memory().total


def test_nvidia_smi_is_asked_once_for_the_budget_and_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []

    def reading() -> int:
        asked.append(1)
        return 80 * 1024**3

    monkeypatch.setattr(footprint, "gpu_memory_bytes", reading)
    footprint.visible_gpu_memory_bytes.cache_clear()
    try:
        assert footprint.default_budget_bytes(None, "cuda") == footprint.models_memory_bytes("cuda") == 80 * 1024**3
        assert len(asked) == 1
    finally:
        footprint.visible_gpu_memory_bytes.cache_clear()
