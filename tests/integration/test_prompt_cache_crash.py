"""Crash safety of the SSD tier: processes killed (SIGKILL) at random points while they write
cache files never leave a file that is accepted torn. A file exists under its final name
only once complete; leftovers are temp files, deleted by the next scan."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from mlxd.engine.cache import kv_files
from mlxd.engine.cache.ssd_tier import SsdTier
from tests.support import EngineProcess, running_engine, wait_for

# A writer that never stops: 1-2 MB files in small chunks, each a new entry.
WRITER = r"""
import sys, os
from pathlib import Path
from mlxd.engine.cache import kv_files
from mlxd.engine.cache.kv_files import Tensor
kv_files.WRITE_CHUNK = 64 * 1024
out = Path(sys.argv[1])
blob = os.urandom(2 * 1024 * 1024)
print("ready", flush=True)
i = 0
while True:
    data = blob[i % 4096:][:1024 * 1024 + (i % 7) * 131072]
    tensor = Tensor("0.0", "U8", (len(data),), memoryview(data))
    kv_files.write_file(out, f"{i:06d}.safetensors", list(range(i % 50 + 1)), {"1.0": "KVCache"}, [tensor])
    i += 1
"""


def test_a_writer_killed_at_random_points_never_leaves_a_torn_file(tmp_path: Path) -> None:
    rng = random.Random(11)
    out = tmp_path / "tier"
    out.mkdir()
    mid_write = 0
    for _ in range(30):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(out)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.15))  # on purpose: a kill at a random point of the writes
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        mid_write += any(p.name.startswith(kv_files.TEMP_PREFIX) for p in out.iterdir())
        tier = SsdTier(out, 1 << 40)  # what the next engine's scan sees
        assert not any(p.name.startswith(kv_files.TEMP_PREFIX) for p in out.iterdir())
        for entry in tier.entries():
            header = kv_files.verify(out / entry.name)  # every file under a final name is whole
            assert header.tokens == list(range(len(entry.tokens)))
        assert tier.stats.quarantined == 0
    assert mid_write >= 5, mid_write  # kills landed inside writes (about half of them do)


def test_engines_killed_while_writing_behind_restart_to_whole_files_and_right_answers(
    tiny_model: Path, tmp_path: Path,
) -> None:
    rng = random.Random(5)
    kv = ("--ssd-cache-dir", str(tmp_path / "kv"))
    prompts = [f"Run {i}: " + "the keeper lit the lamp and wrote another letter. " * 60 for i in range(4)]
    reference: dict[str, str] = {}  # the answers of an engine with no SSD tier
    with running_engine(tiny_model, "m", "--ssd-cache-bytes", "0") as plain:
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
            reference[prompt] = plain.client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    for run in range(4):
        engine = EngineProcess(tiny_model, "m", *kv)
        try:
            engine.wait_ready()
            body = {"prompt": prompts[run], "max_tokens": 6, "temperature": 0}
            assert engine.client.post("/v1/completions", json=body).status_code == 200
            time.sleep(rng.uniform(0.0, 0.03))  # the idle engine is writing its entry behind now
        finally:
            os.kill(engine.proc.pid, signal.SIGKILL)
            engine.stop()
        (tier_dir,) = (tmp_path / "kv").iterdir()
        for path in tier_dir.glob("*.safetensors"):
            kv_files.verify(path)  # never torn
    with running_engine(tiny_model, "m", *kv) as engine:
        assert not list(tier_dir.glob(kv_files.TEMP_PREFIX + "*"))  # the killed engines' temps: gone at start
        for prompt in prompts:
            answer = engine.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6,
                                                                 "temperature": 0}).json()
            assert answer["choices"][0]["text"] == reference[prompt]
        assert wait_for(lambda: engine.stats()["prompt_cache"]["ssd"]["quarantined"] == 0)
        # This engine writes behind too (entries the killed ones never finished): its own temps
        # come and go, and none stays once it is idle.
        assert wait_for(lambda: not list(tier_dir.glob(kv_files.TEMP_PREFIX + "*")), 30)
