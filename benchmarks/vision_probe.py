"""One image request to a bare engine on a tiny random VLM, its whole log printed: a quick look at a
machine where benchmarks/vision.py fails (on a GPU, the engine's CUDA paths).

  python benchmarks/vision_probe.py [--family qwen2_vl] [ENGINE FLAGS...]
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vision import image_png  # noqa: E402

from mlxd.engine.models.random_vlm import build_random_vlm  # noqa: E402


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("engine", timeout=600)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(self.path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--family", default="qwen2_vl")
    p.add_argument("--bias", action="store_true", help="bias tokens 200 and up away, as vision.py's ASCII bias does")
    args, flags = p.parse_known_args()
    work = Path(tempfile.mkdtemp(prefix="mlxd-probe-"))
    os.chmod(work, 0o700)
    model = build_random_vlm(work / "model", args.family)
    sock = work / "e.sock"
    log = (work / "engine.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "mlxd.engine", "--model", str(model), "--model-id", "vlm",
                             "--socket", str(sock), "--ssd-cache-dir", str(work / "kv"), *flags], stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(3000):
            if proc.poll() is not None or sock.exists():
                break
            time.sleep(0.1)
        uri = "data:image/png;base64," + base64.b64encode(image_png(1, 112)).decode()
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                          {"type": "text", "text": "What is it?"}]}],
                "max_tokens": 8, "temperature": 0}
        if args.bias:
            vocab = json.loads((model / "config.json").read_text())["vocab_size"]
            body["logit_bias"] = {str(i): -100.0 for i in range(200, vocab)}
        for _attempt in range(600):
            try:
                conn = UnixConnection(str(sock))
                conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
                resp = conn.getresponse()
                text = resp.read().decode()
                if resp.status == 503:
                    time.sleep(0.5)
                    continue
                print(resp.status, text[:500])
                break
            except OSError as exc:
                print("no answer:", exc)
                time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        print((work / "engine.log").read_text(errors="replace")[-12000:])


if __name__ == "__main__":
    main()
