"""A short run of benchmarks/chaos.py's storm: engine SIGKILLs under 8 streams, one of them the
spare's, with a crash limit low enough to trip (see the script for the full 100-kill run)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from benchmarks.chaos import ChaosOptions, run_chaos
from tests.support import SupervisorProcess

POOL = "[pool]\ncrash_limit = 3\ncrash_window_s = 30\ncooldown_s = 1\ncooldown_max_s = 2\n"


@pytest.mark.slow  # about 18 s on 2 cores
def test_five_kills_under_eight_streams_end_every_request_cleanly_and_heal(tiny_model: Path, tmp_path: Path) -> None:
    env = {"MLXD_SPARE_ENGINE": "1", "MLXD_ENGINE_BACKOFF_S": "0.1"}
    sup = SupervisorProcess(f'{POOL}\n[models.tiny]\npath = "{tiny_model}"\n', tmp_path, env=env).wait_up()
    try:
        opts = ChaosOptions(kills=5, streams=8, spare_every=5, dwell_s=0.5, max_tokens=32)
        report = asyncio.run(run_chaos(sup.url, sup.proc.pid, "tiny", opts, log=lambda _: None))
    finally:
        sup.stop()
    errors = [line for line in sup.log().splitlines() if "Traceback" in line or "ERROR" in line or "Error" in line]
    shown = json.dumps(report, indent=1) + "\n" + "\n".join(errors[-40:])
    assert report["kills"] == {"engine": 4, "spare": 1}, shown
    assert all(report["checks"].values()), shown
    assert report["outcomes"].get("503_retry_after", 0) > 0, shown  # the third kill tripped the limit
    assert report["outcomes"].get("sse_error", 0) > 0, shown
