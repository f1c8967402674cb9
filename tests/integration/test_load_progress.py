"""A starting model says how far it has got: the engine's /health, the supervisor's
/admin/engines and /v1/models, `mlxd ps` and `mlxd load`."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pexpect
import pytest

from mlxd.cli.admin.tables import state_text
from mlxd.engine.models.load_meter import LoadMeter
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.protocol.stats import LoadPhase
from tests.support import SupervisorProcess, serving, wait_for


class RecordingMeter(LoadMeter):
    """A real meter that also keeps every progress it was set to."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[LoadPhase, int, int | None]] = []

    def begin(self, phase: LoadPhase, total: int | None = None, unit: Any = None) -> None:
        super().begin(phase, total, unit)
        self._note()

    def advance(self, amount: int) -> None:
        super().advance(amount)
        self._note()

    def _note(self) -> None:
        now = self.snapshot()
        assert now is not None
        self.seen.append((now.phase, now.done, now.total))


def test_a_load_reads_every_weight_byte_then_the_tokenizer(tiny_model: Path) -> None:
    meter = RecordingMeter()
    loaded = LoadedModel(tiny_model, "tiny", meter=meter)
    weights = [s for s in meter.seen if s[0] == "weights"]
    total = sum(v.nbytes for v in _leaves(loaded.model.parameters()))
    assert weights[0] == ("weights", 0, total) and weights[-1] == ("weights", total, total)
    assert [phase for phase, *_ in meter.seen][-1] == "tokenizer"
    assert loaded.tokenizer.encode("hello")  # the model loaded as mlx-lm's load would


def _leaves(tree: Any) -> Iterator[Any]:
    from mlx.utils import tree_flatten

    return (v for _, v in tree_flatten(tree))


@pytest.fixture
def supervisor(tiny_model: Path, tmp_path: Path) -> Iterator[SupervisorProcess]:
    with serving(tiny_model, "tiny", tmp_path / "data") as sup:
        yield sup


def test_a_starting_model_shows_its_progress_until_it_is_ready(supervisor: SupervisorProcess) -> None:
    loads: list[tuple[str, Any]] = []
    result: dict[str, Any] = {}
    loader = threading.Thread(target=lambda: result.update(supervisor.client.post("/admin/load", json={"model": "tiny"}).json()))
    loader.start()

    def seen_starting() -> bool:
        row = next((r for r in supervisor.client.get("/admin/engines").json()["data"] if r["model"] == "tiny"), None)
        entry = next(m for m in supervisor.client.get("/v1/models").json()["data"] if m["id"] == "tiny")
        if row is not None:
            loads.append((row["state"], row["load"]))
            loads.append((entry["state"], entry["load"]))
        return row is not None and row["load"] is not None and entry["load"] is not None

    # The engine's imports alone take a second or more: its `spawn` phase is there to see.
    assert wait_for(seen_starting, timeout=30), loads
    state, load = loads[-1]
    assert state == "starting" and load["phase"] in ("spawn", "weights", "tokenizer") and load["elapsed_s"] >= 0
    assert "starting (" in state_text({"state": state, "load": load})
    loader.join(timeout=60)
    assert result["state"] == "ready"
    row = next(r for r in supervisor.client.get("/admin/engines").json()["data"] if r["model"] == "tiny")
    assert row["state"] == "ready" and row["load"] is None


def test_mlxd_load_draws_the_progress_on_a_terminal(supervisor: SupervisorProcess) -> None:
    child = pexpect.spawn(sys.executable, ["-m", "mlxd", "load", "tiny", "--url", supervisor.url],
                          encoding="utf-8", timeout=60, dimensions=(24, 120))
    child.expect("tiny: starting the engine")  # the spinner's line, while the engine imports
    child.expect("tiny is ready")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_mlxd_load_prints_no_progress_to_a_pipe(supervisor: SupervisorProcess) -> None:
    import subprocess

    done = subprocess.run([sys.executable, "-m", "mlxd", "load", "tiny", "--url", supervisor.url],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("tiny is ready") and done.stderr == ""


def test_ps_names_the_phase() -> None:
    assert state_text({"state": "starting", "load": {"phase": "weights", "done": 50, "total": 200,
                                                      "unit": "bytes", "elapsed_s": 1.0}}) \
        == "starting (reading weights 25%)"
    assert state_text({"state": "starting", "load": {"phase": "spawn", "done": 0, "total": None,
                                                      "unit": None, "elapsed_s": 1.25}}) \
        == "starting (starting the engine 1.2 s)"
    assert state_text({"state": "ready", "load": None}) == "ready"


def test_a_stream_waiting_for_a_cold_model_hears_its_progress(tiny_model: Path, tmp_path: Path) -> None:
    config = f'[server]\nstream_keepalive_s = 0.2\n\n[models.tiny]\npath = "{tiny_model}"\n'
    sup = SupervisorProcess(config, tmp_path / "data").wait_up()
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        raw = sup.client.post("/v1/chat/completions", json=body).text
    finally:
        sup.stop()
    # the engine's imports take far longer than 0.2 s: the first comments name that phase
    assert ": waiting for the model: starting the engine (" in raw, raw[:300]
    assert raw.rstrip().endswith("data: [DONE]")
