"""What a load with progress costs: mlxd's loader (weights evaluated 64 MB at a time, so that
/health can say how far it got) against mlx-lm's `load` (all at once), and the phases a real
engine reports while it starts.

Each round loads the model once each way, in fresh processes taking turns (the files stay in
the page cache after the first round, so both read from RAM), timed inside the process from
before the load to after it; medians and their ratio. Then one engine is started and its
/health polled every 20 ms: the phases it went through, with their counts.

  python benchmarks/load_progress.py --model PATH [--rounds 5]
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TIMED = {
    "mlx_lm.load": "from mlx_lm import load; load(PATH)",
    "mlxd load": ("from mlxd.engine.models.loaded_model import load_with_progress; "
                  "from mlxd.engine.models.load_meter import LoadMeter; load_with_progress(Path(PATH), LoadMeter())"),
}
HARNESS = """
import time, sys; from pathlib import Path; PATH = sys.argv[1]
import mlx.core as mx, mlx_lm, mlxd.engine.models.loaded_model  # imports are not the load
t0 = time.perf_counter(); {code}; mx.synchronize(); print(time.perf_counter() - t0)
"""


def timed_load(kind: str, model: Path) -> float:
    """Seconds one fresh process takes to load `model` the `kind` way."""
    out = subprocess.run([sys.executable, "-c", HARNESS.format(code=TIMED[kind]), str(model)],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return float(out.stdout.strip().splitlines()[-1])


class UnixConnection(http.client.HTTPConnection):
    """http.client over the engine's Unix socket (the stdlib only: the GPU machine has no httpx)."""

    def __init__(self, path: Path) -> None:
        super().__init__("engine", timeout=2)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(2)
        self.sock.connect(str(self.path))


def health(sock: Path) -> dict[str, Any] | None:
    """The engine's /health body; None while it does not answer."""
    conn = UnixConnection(sock)
    try:
        conn.request("GET", "/health")
        return dict(json.loads(conn.getresponse().read()))
    except OSError:
        return None
    finally:
        conn.close()


def phases_seen(model: Path) -> list[dict[str, object]]:
    """A real engine's /health `load`, each change of phase (and its last count), as it starts."""
    sock = Path(tempfile.mkdtemp(prefix="lp-")) / "e.sock"
    proc = subprocess.Popen([sys.executable, "-m", "mlxd.engine", "--model", str(model), "--model-id", "m",
                             "--socket", str(sock)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=ROOT)
    seen: list[dict[str, object]] = []
    started = time.monotonic()
    try:
        while time.monotonic() - started < 600:
            if (body := health(sock)) is None:
                time.sleep(0.02)
                continue
            if body["status"] != "loading":
                seen.append({"phase": body["status"], "at_s": round(time.monotonic() - started, 2)})
                break
            if load := body.get("load"):
                load["at_s"] = round(time.monotonic() - started, 2)
                if seen and seen[-1]["phase"] == load["phase"]:
                    seen[-1] = load
                else:
                    seen.append(load)
            time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(30)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for kind in TIMED:  # a first load of each, not counted: the files into the page cache
        timed_load(kind, args.model)
    times: dict[str, list[float]] = {kind: [] for kind in TIMED}
    for i in range(args.rounds):
        for kind in (list(TIMED) if i % 2 == 0 else list(reversed(TIMED))):
            times[kind].append(timed_load(kind, args.model))
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    for kind, values in times.items():
        print(f"{kind:18} median {medians[kind] * 1000:8.1f} ms  (all: {', '.join(f'{v * 1000:.0f}' for v in values)})")
    print(f"ratio mlxd / mlx-lm: {medians['mlxd load'] / medians['mlx_lm.load']:.3f}")
    print("phases an engine reported while it started:")
    for phase in phases_seen(args.model):
        print("  " + json.dumps(phase))


if __name__ == "__main__":
    main()
